"""The planner's subcommands on the `cbserve` CLI: `profile` (profile_command.py), `plan` (plan_command.py)."""

from __future__ import annotations

import argparse


def add_planner_commands(sub: argparse._SubParsersAction, add_engine_flags) -> None:
    from cbserve.planner.plan_command import add_plan_command
    from cbserve.planner.profile_command import add_profile_command

    add_profile_command(sub, add_engine_flags)
    add_plan_command(sub, add_engine_flags)
