"""The router flags for structured outputs, tool calls and reasoning (vLLM's names where vLLM has
them), their checks, and the per-app `OutputFeatures` they build."""

from __future__ import annotations

import argparse
from typing import Any

from router.reasoning.parser import REASONING_PARSERS
from router.structured.validate import StructuredLimits
from router.tools.formats import TOOL_CALL_PARSERS


def check_output_flags(config: Any) -> None:
    """Raise ValueError for an unknown parser, auto tool choice without one, or a limit below 1."""
    if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got {config.tool_call_parser!r}")
    if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {config.reasoning_parser!r}")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (which format to read calls in)")
    limits(config)


def limits(config: Any) -> StructuredLimits:
    return StructuredLimits(config.max_schema_bytes, config.max_schema_depth, config.max_tools)


def add_output_arguments(p: argparse.ArgumentParser, defaults: Any) -> None:
    """`--tool-call-parser`, `--enable-auto-tool-choice`, `--reasoning-parser` and the limits."""
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                   help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), llama3_json, mistral")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the model decides; calls are read with --tool-call-parser)')
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="reasoning models: <think>...</think> goes to reasoning_content, and grammars and tool "
                        "calls apply after it")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='leave the tools out of the prompt when tool_choice is "none"')
    p.add_argument("--max-schema-bytes", type=int, default=defaults.max_schema_bytes,
                   help="largest JSON schema, regex, grammar or choice list in a request (canonical bytes)")
    p.add_argument("--max-schema-depth", type=int, default=defaults.max_schema_depth,
                   help="deepest nesting of objects and arrays in one schema")
    p.add_argument("--max-tools", type=int, default=defaults.max_tools, help="most tools in one request")


def output_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags `add_output_arguments` added."""
    return {"tool_call_parser": args.tool_call_parser, "enable_auto_tool_choice": args.enable_auto_tool_choice,
            "reasoning_parser": args.reasoning_parser,
            "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
            "max_schema_bytes": args.max_schema_bytes, "max_schema_depth": args.max_schema_depth,
            "max_tools": args.max_tools}


# The flags `cbserve up` passes through to its router (the same names).
UP_FLAGS = ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser")


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """`cbserve up`'s copies of the tool and reasoning flags."""
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                   help="the router's tool-call format (see `cbserve router --help`)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help='the router allows tool_choice "auto"')
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="the router splits <think>...</think> into reasoning_content")


def up_router_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The `cbserve router` flags for what `add_up_arguments` parsed."""
    argv: list[str] = []
    for name in UP_FLAGS:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value:
            argv += [flag, value]
    return tuple(argv)

