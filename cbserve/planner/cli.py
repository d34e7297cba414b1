"""The planner's subcommands on the `cbserve` CLI: `profile` (profile_command.py), `plan` (plan_command.py)."""

from __future__ import annotations

import argparse


def add_planner_commands(sub: argparse._SubParsersAction, add_engine_flags, engine_config_from_args) -> None:
    """`engine_config_from_args` (`cbserve.cli`'s, passed in: importing it would close a circle)
    builds the pods' engine config from the engine flags; both commands keep it in their args."""
    from cbserve.planner.plan_command import add_plan_command
    from cbserve.planner.profile_command import add_profile_command

    for add in (add_profile_command, add_plan_command):
        before = set(sub.choices)
        add(sub, add_engine_flags)
        for name in set(sub.choices) - before:
            sub.choices[name].set_defaults(engine_config_from_args=engine_config_from_args)
