"""The router's cost of structured outputs and tools: validation per request, parsing per token.

Validation: what a request pays before it is routed, in the router's worker thread: the
constraint turned into its canonical `StructuredSpec` and checked by llguidance
(`SpecValidator.spec_for`), or, for tools, every tool checked and the forced-call grammar built
and checked (`tool_request` + `chat_plan`). Cases: a set of typical response schemas, one schema
of 200 properties (both cold: llguidance runs every time), and 128 tools with `tool_choice:
"required"`, cold (first request) and warm (the same tools again: the validator remembers
verdicts by spec key, as an agent's every turn sends the same tools). Each runs `--repeats` times
against the tiny preset's byte-level tokenizer and against a synthetic 150k-token vocabulary
(llguidance validates with the model's tokenizer); the table gives p50 / p99 of thread CPU time in ms.

Parsing: one choice's output through `ChoiceOutput` (reasoning split + tool-call parser), fed in
pieces of `--chars-per-token` characters as a stream would be: µs per piece (one "token"), for
plain content with no parser (the baseline pass-through), content with the hermes parser on,
hermes tool calls, and deepseek_r1 reasoning followed by calls.

    .venv/bin/python bench/structured_router.py [--repeats 50] [--chars-per-token 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.presets import resolve_model_dir  # noqa: E402
from engine.tokenizer import Tokenizer, _byte_to_unicode  # noqa: E402
from router.chat_output import ChoiceOutput, OutputSpec  # noqa: E402
from router.reasoning.parser import REASONING_PARSERS  # noqa: E402
from router.structured.plan import OutputFeatures, chat_plan  # noqa: E402
from router.structured.surface import Constraint  # noqa: E402
from router.structured.validate import SpecValidator, StructuredLimits  # noqa: E402
from router.tools.fields import Tool  # noqa: E402
from router.tools.formats import HERMES  # noqa: E402
from router.tools.request import tool_request  # noqa: E402

TYPICAL = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "maximum": 99},
        "price": {"type": "number"}}, "required": ["sku", "qty"]}, "maxItems": 20},
        "status": {"enum": ["open", "paid", "shipped"]}, "note": {"type": ["string", "null"]}},
     "required": ["items", "status"]},
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 200},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                      "sources": {"type": "array", "items": {"type": "string", "format": "uri"}}},
     "required": ["answer", "confidence", "sources"], "additionalProperties": False},
    {"$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"},
                                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                           "required": ["street", "zip"]}},
     "type": "object", "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"},
                                      "email": {"type": "string", "format": "email"}},
     "required": ["home", "email"]},
    {"type": "object", "properties": {"event": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                          "y": {"type": "integer"}}, "required": ["kind", "x", "y"]},
        {"type": "object", "properties": {"kind": {"const": "key"}, "code": {"type": "string"}},
         "required": ["kind", "code"]}]}, "at": {"type": "string", "format": "date-time"}},
     "required": ["event", "at"]},
]
BIG = {"type": "object", "properties": {f"field_{i}": [{"type": "string", "maxLength": 40}, {"type": "integer"},
                                                       {"type": "boolean"}, {"enum": ["a", "b", "c"]}][i % 4]
                                        for i in range(200)},
       "required": [f"field_{i}" for i in range(0, 200, 2)], "additionalProperties": False}


def tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
                                         "mode": {"enum": ["fast", "exact"]}},
        "required": ["query"], "additionalProperties": False}}} for i in range(count)]


def big_vocab_json(size: int = 150_000) -> str:
    """A byte-level BPE vocabulary of `size` tokens (random words), as tokenizer.json text."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    b2u = _byte_to_unicode()
    vocab = {c: i for i, c in enumerate(b2u.values())}
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz" + b2u[32] * 3 + '{}":,_'
    while len(vocab) < size:
        vocab.setdefault("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))), len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend.to_str()


def timed(work, repeats: int) -> tuple[float, float]:
    """p50 and p99 of `work()`'s CPU time on this thread, in ms (CPU time, not wall: on a shared,
    loaded machine wall time mostly measures waiting for a core)."""
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        work()
        samples.append(time.thread_time() - start)
    samples.sort()
    return statistics.median(samples) * 1e3, samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3


def validation_rows(tokenizer: Tokenizer, tokenizer_json: str, label: str, repeats: int) -> list[str]:
    validator = SpecValidator(StructuredLimits(max_schema_bytes=1 << 20), tokenizer_json, tokenizer.eos_token_ids)
    features = OutputFeatures(validator, tokenizer, HERMES)
    rows = []
    for name, schemas in (("typical schemas (5, each)", TYPICAL), ("200-property schema", [BIG])):
        def cold(schema) -> None:
            validator._verdicts.clear()          # every repeat validates: the cold cost
            validator.spec_for(Constraint("json_schema", schema, "bench"))
        p50s, p99s = zip(*(timed(lambda s=s: cold(s), repeats) for s in schemas))
        rows.append(f"| {name} | {label} | {statistics.median(p50s):.2f} | {max(p99s):.2f} |")
    body = SimpleNamespace(tools=[Tool.model_validate(t) for t in tools(128)], functions=None, tool_choice="required",
                           function_call=None, parallel_tool_calls=None)

    def forced_128() -> None:
        request = tool_request(body, validator, has_parser=True, auto_enabled=True)
        chat_plan(features, None, request, "prompt")
    p50, p99 = timed(forced_128, 1)          # cold: nothing remembered yet
    rows.append(f"| 128 tools, tool_choice required (hermes grammar), cold | {label} | {p50:.2f} | — |")
    p50, p99 = timed(forced_128, repeats)
    rows.append(f"| 128 tools, tool_choice required, warm (same tools again) | {label} | {p50:.2f} | {p99:.2f} |")
    return rows


HERMES_CALLS = "".join(f'<tool_call>\n{{"name": "tool_{i}", "arguments": {{"query": "what is the weather in city '
                       f'number {i}", "limit": {i}, "mode": "fast"}}}}\n</tool_call>\n' for i in range(8))
PROSE = ("The quick brown fox jumps over the lazy dog, and then it writes a long answer with a few "
         "numbers (1, 2, 3) and some {braces} and <angle> brackets. ") * 12


def parse_rows(chars_per_token: int, repeats: int) -> list[str]:
    r1 = REASONING_PARSERS["deepseek_r1"]
    cases = [("content, no parser (pass-through)", OutputSpec(), PROSE),
             ("content, hermes parser on", OutputSpec(tools=HERMES.parse), PROSE),
             ("8 hermes tool calls", OutputSpec(tools=HERMES.parse), HERMES_CALLS),
             ("deepseek_r1 reasoning, then 8 calls", OutputSpec(r1, "", HERMES.parse),
              PROSE[:600] + "</think>\n\n" + HERMES_CALLS)]
    rows = []
    for name, spec, text in cases:
        pieces = [text[i:i + chars_per_token] for i in range(0, len(text), chars_per_token)]

        def stream() -> None:
            output = ChoiceOutput(spec) if spec.active else None
            for piece in pieces:
                if output is not None:
                    output.feed(piece)
            if output is not None:
                output.finish()
        p50, p99 = timed(stream, repeats)
        rows.append(f"| {name} | {len(pieces)} | {p50 * 1e3 / len(pieces):.2f} | {p99 * 1e3 / len(pieces):.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--chars-per-token", type=int, default=4)
    args = parser.parse_args()
    tiny = Tokenizer.from_pretrained(resolve_model_dir("tiny", create_weights=False))
    print("| validation | tokenizer | p50 ms | p99 ms |\n|---|---|---|---|")
    for row in validation_rows(tiny, tiny.to_json(), "tiny (260)", args.repeats):
        print(row)
    for row in validation_rows(tiny, big_vocab_json(), "synthetic 150k", args.repeats):
        print(row)
    print(f"\n| parsing, {args.chars_per_token} chars per token | tokens | µs/token p50 | µs/token p99 (run) |\n"
          "|---|---|---|---|")
    for row in parse_rows(args.chars_per_token, args.repeats):
        print(row)


if __name__ == "__main__":
    main()
