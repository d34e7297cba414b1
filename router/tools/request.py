"""A chat request's tools, checked and reduced to one `ToolRequest`.

Rules (OpenAI's, and vLLM's where OpenAI is silent):
- the legacy `functions` / `function_call` are `tools` / `tool_choice` under other names (both
  spellings at once is a 400); the answer then uses the legacy `function_call` shape too;
- with tools, `tool_choice` defaults to `auto`; without, to `none`, and `required` with no tools
  behaves as `none`; a named function must be one of the tools;
- `auto` needs a tool-call parser and `--enable-auto-tool-choice` (vLLM's flags): without them
  nothing would read the calls out of the text, so it is a 400 rather than a silent reply;
- names are OpenAI's `[a-zA-Z0-9_-]{1,64}` and unique; every `parameters` schema must compile
  (the same llguidance check as `response_format`), within `--max-schema-bytes/-depth`, and there
  are at most `--max-tools` tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from router.errors import bad_request
from router.structured.surface import Constraint
from router.structured.validate import SpecValidator

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool = False         # OpenAI's `strict`: calls must match `parameters`

    def template_tool(self) -> dict[str, Any]:
        """The OpenAI tool object chat templates are given (`tool.function.name`, ...)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object",
                                                                                       "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: which, and how the model may or must call them."""

    tools: tuple[FunctionSpec, ...]
    choice: str                  # "none" | "auto" | "required" | "named"
    named: str | None = None     # the function `choice == "named"` forces
    parallel: bool = True        # more than one call allowed
    legacy: bool = False         # asked with `functions`: answer with `function_call`

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def strict(self) -> bool:
        """A tool asks for `strict` calls: under `auto` every call is held to its tool's schema."""
        return any(t.strict for t in self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def forced_tools(self) -> list[tuple[str, dict[str, Any] | None]]:
        tools = [t for t in self.tools if self.choice != "named" or t.name == self.named]
        return [(t.name, t.parameters) for t in tools]


def tool_request(request: Any, validator: SpecValidator, *, has_parser: bool, auto_enabled: bool,
                 flat: bool = False) -> ToolRequest | None:
    """The checked `ToolRequest` of a chat body, or None when it has no tools; 400s name the field
    (`tools[i].name` where the client wrote the Responses API's `flat` tools)."""
    legacy = request.functions is not None or request.function_call is not None
    if request.tools is not None and request.functions is not None:
        raise bad_request("send tools or the legacy functions, not both", param="functions")
    if request.tool_choice is not None and request.function_call is not None:
        raise bad_request("send tool_choice or the legacy function_call, not both", param="function_call")
    param = "functions" if request.functions is not None else "tools"
    definitions = ([t.function for t in request.tools] if request.tools is not None
                   else list(request.functions or ()))
    choice_param = "function_call" if request.function_call is not None else "tool_choice"
    raw_choice = request.function_call if request.function_call is not None else request.tool_choice
    if isinstance(raw_choice, str):
        choice, named = raw_choice, None
    elif raw_choice is not None:
        choice, named = "named", raw_choice.function.name if hasattr(raw_choice, "function") else raw_choice.name
    else:
        choice, named = ("auto" if definitions else "none"), None
    if not definitions:
        if choice == "named":
            raise bad_request(f"{choice_param} names the function {named!r}, but the request has no tools",
                              param=choice_param)
        return None
    limit = validator.limits.max_tools
    if len(definitions) > limit:
        raise bad_request(f"{param}: {len(definitions)} tools; at most {limit} are accepted (--max-tools)",
                          param=param, code="too_many_tools")
    tools, seen = [], set()
    for i, definition in enumerate(definitions):
        where = f"{param}[{i}].function" if param == "tools" and not flat else f"{param}[{i}]"
        if not _NAME.match(definition.name):
            raise bad_request(f"{where}.name must match [a-zA-Z0-9_-]{{1,64}}, got {definition.name!r}",
                              param=f"{where}.name")
        if definition.name in seen:
            raise bad_request(f"{where}.name: two tools are named {definition.name!r}", param=f"{where}.name")
        seen.add(definition.name)
        if definition.parameters is not None:
            validator.spec_for(Constraint("json_schema", definition.parameters, f"{where}.parameters"))
        tools.append(FunctionSpec(definition.name, definition.description, definition.parameters,
                                  definition.strict is True))
    if choice == "named" and named not in seen:
        raise bad_request(f"{choice_param}: no tool is named {named!r}", param=choice_param)
    if choice == "auto" and not (has_parser and auto_enabled):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                          '(send tool_choice "none", "required" or a named function)', param=choice_param)
    parallel = request.parallel_tool_calls is not False and not legacy and choice != "named"
    return ToolRequest(tuple(tools), choice, named, parallel, legacy)


def template_tools(tools: ToolRequest | None, exclude_when_none: bool) -> list[dict[str, Any]] | None:
    """The tools the chat template is given: none without tools, or with `tool_choice: "none"`
    under `--exclude-tools-when-tool-choice-none`."""
    if tools is None or (tools.choice == "none" and exclude_when_none):
        return None
    return [tool.template_tool() for tool in tools.tools]
