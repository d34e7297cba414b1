"""What a chat or completions request asks of the output, as the `StructuredSpec` the pods
enforce and the `OutputSpec` the router reads the text with.

One rule per case:
- a `response_format` / `structured_outputs` / `guided_*` constraint alone: its own spec;
- `tool_choice` `required` or a named function: a grammar of calls in the model's format (the
  configured parser's, else vLLM's plain JSON list), whatever `response_format` says (a forced
  call leaves no text for it to shape);
- `tool_choice` `auto` with a constraint: calls, or an answer in the constraint (an agent that
  sends an output schema and tools gets either), for JSON, regex and choice constraints (a Lark
  grammar has its own `start` and is refused next to tools);
- `auto` with a `strict` tool and no constraint: calls (each held to its tool's schema), or free
  text that the parser reads as no call (`free_answer`);
- `auto` alone: no grammar; the parser reads whatever calls the model writes.
With a reasoning parser the grammar starts at the end of the thinking (`after_token_ids`, the
tokens of `</think>`) unless the prompt already ended it, and the answer is read from there on;
for a model that thinks only when its output opens with `<think>` (qwen3, the prompt opening no
thinking) the grammar instead allows one optional thinking block before the answer (a user Lark
grammar, which has its own start, keeps `after_token_ids`: it is unconstrained if the model skips
thinking).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from engine.grammar.spec import StructuredSpec
from engine.sampling.params import SamplingParams
from engine.tokenizer import Tokenizer
from router.chat_output import OutputSpec
from router.errors import bad_request
from router.reasoning.parser import ReasoningFormat, initial_state
from router.structured.surface import Constraint
from router.structured.validate import SpecValidator
from router.tools.formats import JSON_LIST, ToolCallFormat
from router.tools.grammar import (answer_lark, calls_lark, choice_answer, free_answer, json_answer, regex_answer,
                                  think_block)
from router.tools.request import ToolRequest, tool_request


@dataclass(frozen=True)
class OutputFeatures:
    """The router's structured-output and tool configuration (one per app)."""

    validator: SpecValidator
    tokenizer: Tokenizer
    tool_format: ToolCallFormat | None = None      # --tool-call-parser
    auto_tool_choice: bool = False                 # --enable-auto-tool-choice
    reasoning: ReasoningFormat | None = None       # --reasoning-parser
    exclude_tools_when_tool_choice_none: bool = False

    @classmethod
    def from_config(cls, config: Any, tokenizer: Tokenizer) -> OutputFeatures:
        """From the router flags; loads llguidance's view of the tokenizer (about 2 s for a 150k
        vocabulary: call it off the event loop)."""
        from router.reasoning.parser import REASONING_PARSERS
        from router.structured.flags import limits
        from router.tools.formats import TOOL_CALL_PARSERS

        validator = SpecValidator(limits(config), tokenizer.to_json(), tokenizer.eos_token_ids)
        return cls(validator, tokenizer, TOOL_CALL_PARSERS.get(config.tool_call_parser or ""),
                   config.enable_auto_tool_choice, REASONING_PARSERS.get(config.reasoning_parser or ""),
                   config.exclude_tools_when_tool_choice_none)

    def tool_request(self, request: Any, flat: bool = False) -> ToolRequest | None:
        """The checked tools of a request under this router's parser flags (`tool_request`)."""
        return tool_request(request, self.validator, has_parser=self.tool_format is not None,
                            auto_enabled=self.auto_tool_choice, flat=flat)

    def special_marker_id(self, text: str) -> int | None:
        """The id of `text` if it is one special token (dropped from text by skip_special_tokens)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.tokenizer.decode(ids, skip_special_tokens=True) == "" \
                and self.tokenizer.decode(ids, skip_special_tokens=False) == text:
            return ids[0]
        return None

    def literal(self, text: str) -> str:
        """`text` in a Lark grammar: the special token itself where it is one, else a string."""
        token_id = self.special_marker_id(text)
        return f"<[{token_id}]>" if token_id is not None else _quoted(text)


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class OutputPlan:
    spec: StructuredSpec | None
    output: OutputSpec
    keep_special_tokens: bool = False     # a tool marker is a special token: decode with it


def completion_spec(features: OutputFeatures, constraint: Constraint | None) -> StructuredSpec | None:
    """/v1/completions: the constraint alone, from the first token (no reasoning parsing)."""
    return features.validator.spec_for(constraint) if constraint is not None else None


def chat_plan(features: OutputFeatures, constraint: Constraint | None, tools: ToolRequest | None,
              prompt_text: str) -> OutputPlan:
    """The spec and the output reading of one chat request (see the module note); 400s name fields.

    Runs in a worker thread: validation costs milliseconds for large schemas and many tools."""
    reasoning = features.reasoning
    state = initial_state(reasoning, prompt_text) if reasoning is not None else "content"
    # A model that thinks only if its output opens with the tag (qwen3): an optional thinking
    # block in the grammar itself, else a model that skips thinking would never be constrained.
    # Otherwise the grammar starts after the end tag (`after_token_ids`) unless the prompt ended it.
    think = None
    if state == "opening" and not reasoning.starts_in_reasoning:
        think = think_block(features.literal(reasoning.start_tag), features.literal(reasoning.end_tag))
    after: tuple[int, ...] = ()
    if state != "content":
        after = tuple(features.tokenizer.encode(reasoning.end_tag, add_special_tokens=False))
    fmt = None
    if tools is not None and tools.parses_calls:
        fmt = features.tool_format if features.tool_format is not None else JSON_LIST
    output = OutputSpec(reasoning, prompt_text, fmt.parse if fmt else None, bool(tools and tools.legacy))
    keep_special = fmt is not None and any(features.special_marker_id(m) is not None for m in fmt.markers)
    spec = None
    grammar_after = () if think is not None else after
    calls = None      # (answer beside the calls, its named tokens, the field a 400 names)
    if tools is not None and tools.forced:
        calls = (None, None, "tool_choice")
    elif tools is not None and tools.choice == "auto" and constraint is not None:
        calls = (_answer(constraint, features.validator.spec_for(constraint)), None, constraint.param)
    elif tools is not None and tools.choice == "auto" and tools.strict:
        free = free_answer(fmt.parse, lambda marker: features.special_marker_id(marker) is not None)
        calls = ("FREE_TEXT", {"FREE_TEXT": free}, "tools")
    if calls is not None:
        answer, tokens, param = calls
        grammar = calls_lark(fmt.force, tools.forced_tools(), parallel=tools.parallel, literal=features.literal,
                             answer=answer, think=think, tokens=tokens)
        spec = _lark(features, grammar, grammar_after, param)
    elif constraint is not None:
        spec = features.validator.spec_for(constraint, after)
        if think is not None and spec.kind != "lark":     # a Lark grammar has its own start: after_token_ids
            spec = _lark(features, answer_lark(_answer(constraint, spec), think), (), constraint.param)
    return OutputPlan(spec, output, keep_special)


async def plan_output(encoder: Any, features: OutputFeatures, constraint: Constraint | None,
                      tools: ToolRequest | None, prompt_text: str) -> OutputPlan:
    """`chat_plan` in the encoder's worker threads, or the empty plan (no thread hop) for a request
    that asks for nothing the plan decides."""
    if constraint is None and tools is None and features.reasoning is None:
        return OutputPlan(None, OutputSpec())
    return await encoder.run(lambda: chat_plan(features, constraint, tools, prompt_text))


def _answer(constraint: Constraint, spec: StructuredSpec) -> str:
    """`constraint` (validated as `spec`) as a Lark expression, to offer next to tool calls."""
    if spec.kind == "lark":
        raise bad_request(f"{constraint.param} cannot be combined with tools when tool_choice is 'auto' (use "
                          f"json, regex or choice, or tool_choice 'none')", param=constraint.param)
    if spec.kind == "regex":
        return regex_answer(spec.text)
    if spec.kind == "choice":
        return choice_answer(json.loads(spec.text))
    schema: Any = json.loads(spec.text) if spec.kind == "json_schema" else None
    return json_answer(schema, spec.any_whitespace)


def _lark(features: OutputFeatures, grammar: str, after: tuple[int, ...], param: str) -> StructuredSpec:
    # No size check of its own: every tool's schema was checked, and their number is bounded.
    spec = StructuredSpec("lark", grammar, after_token_ids=after)
    features.validator.validate(spec, param)
    return spec


def with_plan(params: SamplingParams, plan: OutputPlan) -> SamplingParams:
    """`params` carrying the plan's spec (and keeping special tokens in the text where it must)."""
    if plan.spec is None and not plan.keep_special_tokens:
        return params
    return replace(params, structured=plan.spec,
                   skip_special_tokens=params.skip_special_tokens and not plan.keep_special_tokens)
