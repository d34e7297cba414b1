"""Request traces: a sample of real traffic's shapes, replayed as open-loop load at any rate.

A trace is JSON lines, one request each:

    {"prompt_tokens": 812, "output_tokens": 180}
    {"prompt_tokens": 1400, "output_tokens": 64, "prefix_group": "rag-7", "prefix_tokens": 1024}

`prompt_tokens` (>= 2) counts the whole prompt, bos included; `output_tokens` (>= 1) is the answer's
length (requests set `ignore_eos`, so it is exact). Requests of one `prefix_group` (a string or an
integer) start with the same `prefix_tokens` tokens (2 <= prefix_tokens < prompt_tokens, the same on
every line of the group): a shared system prompt or document, which pods may serve from their
prefix cache. No other fields are accepted, so a misspelt one is an error, not a silent default.

Replay (`Trace.requests`): arrivals are `bench/goodput.py`'s (exactly round(rate x duration)
instants, uniform, so exponential gaps; seeded by seed, trace name, rate and duration); request i
takes row `order[i % len(rows)]`, where `order` is one seeded shuffle of the rows, the same at every
rate (a higher rate replays a longer stretch of the same sequence). Prompts are random letters, as
the built-in mixes' are: with the byte-level presets' tokenizer a prompt of B bytes is B + 1
tokens, so lengths are exact there (with another tokenizer they are approximate).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cbserve.goodput.workloads import RequestSpec, arrival_times, random_text

FIELDS = ("prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRow:
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Trace:
    """A parsed trace; offers the same interface as a `Mix` (`requests`, `warmup`, `prefix_caching`,
    `max_total_tokens`), so the benchmark and the planner take either."""

    name: str
    rows: tuple[TraceRow, ...]

    @property
    def description(self) -> str:
        groups = len({r.prefix_group for r in self.rows if r.prefix_group is not None})
        prompts = sorted(r.prompt_tokens for r in self.rows)
        outputs = sorted(r.output_tokens for r in self.rows)
        return (f"trace of {len(self.rows)} requests: prompt tokens p50 {prompts[len(prompts) // 2]} "
                f"max {prompts[-1]}, output tokens p50 {outputs[len(outputs) // 2]} max {outputs[-1]}"
                + (f", {groups} prefix groups" if groups else ""))

    @property
    def prefix_caching(self) -> bool:
        """Pods cache prefixes only where prompts share them (as for the mixes)."""
        return any(r.prefix_group is not None for r in self.rows)

    @property
    def max_total_tokens(self) -> int:
        return max(r.prompt_tokens + r.output_tokens for r in self.rows)

    def _prefixes(self, seed: int) -> dict[str, str]:
        """Each group's shared text: bos + (prefix_tokens - 1) bytes."""
        tokens = {r.prefix_group: r.prefix_tokens for r in self.rows if r.prefix_group is not None}
        return {g: random_text(random.Random(f"{seed}:{self.name}:prefix:{g}"), n - 1) for g, n in tokens.items()}

    def _prompt(self, row: TraceRow, prefixes: dict[str, str], rng: random.Random) -> str:
        if row.prefix_group is None:
            return random_text(rng, row.prompt_tokens - 1)
        return prefixes[row.prefix_group] + random_text(rng, row.prompt_tokens - row.prefix_tokens)

    def order(self, seed: int) -> list[int]:
        """The replay order of the rows (the same for every rate of a seed)."""
        order = list(range(len(self.rows)))
        random.Random(f"{seed}:{self.name}:order").shuffle(order)
        return order

    def requests(self, rate: float, duration_s: float, seed: int) -> list[RequestSpec]:
        rng = random.Random(f"{seed}:{self.name}:{rate}:{duration_s}")
        prefixes, order = self._prefixes(seed), self.order(seed)
        out = []
        for index, t in enumerate(arrival_times(rate, duration_s, rng)):
            row = self.rows[order[index % len(order)]]
            out.append(RequestSpec(index, t, self._prompt(row, prefixes, rng), row.output_tokens))
        return out

    def warmup(self, seed: int, count: int, max_tokens: int = 8) -> list[RequestSpec]:
        """At least `count` short requests, 0.5 s apart, that use every prefix group once (so the
        measured rates meet warm prefix caches, as the mixes' warm-up does)."""
        rng = random.Random(f"{seed}:{self.name}:warmup")
        prefixes = self._prefixes(seed)
        first_of_group = list({r.prefix_group: r for r in self.rows if r.prefix_group is not None}.values())
        rows = first_of_group + [self.rows[i] for i in self.order(seed)]
        rows = rows[:max(count, len(first_of_group))]
        return [RequestSpec(i, 0.5 * i, self._prompt(row, prefixes, rng), max_tokens) for i, row in enumerate(rows)]


def _int_field(obj: dict, field: str, where: str, minimum: int) -> int:
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {field} must be an integer, got {json.dumps(value)}")
    if value < minimum:
        raise TraceError(f"{where}: {field} must be >= {minimum}, got {value}")
    return value


def parse_row(obj: object, where: str) -> TraceRow:
    """One line's request; raises TraceError naming `where` (file:line) and the field."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    for field in ("prompt_tokens", "output_tokens"):
        if field not in obj:
            raise TraceError(f"{where}: {field} is required")
    prompt = _int_field(obj, "prompt_tokens", where, 2)
    output = _int_field(obj, "output_tokens", where, 1)
    has_group, has_tokens = "prefix_group" in obj, "prefix_tokens" in obj
    if has_group != has_tokens:
        raise TraceError(f"{where}: {'prefix_tokens' if has_group else 'prefix_group'} is required with "
                         f"{'prefix_group' if has_group else 'prefix_tokens'}")
    if not has_group:
        return TraceRow(prompt, output)
    group = obj["prefix_group"]
    if isinstance(group, bool) or not isinstance(group, (str, int)) or group == "":
        raise TraceError(f"{where}: prefix_group must be a non-empty string or an integer, got {json.dumps(group)}")
    prefix = _int_field(obj, "prefix_tokens", where, 2)
    if prefix >= prompt:
        raise TraceError(f"{where}: prefix_tokens ({prefix}) must be < prompt_tokens ({prompt})")
    return TraceRow(prompt, output, str(group), prefix)


def parse_trace(lines: Iterable[str], name: str, source: str = "<trace>") -> Trace:
    """A trace from JSON lines (blank lines skipped); raises TraceError at the first bad line."""
    rows: list[TraceRow] = []
    group_tokens: dict[str, tuple[int, int]] = {}   # group -> (prefix_tokens, first line)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        row = parse_row(obj, where)
        if row.prefix_group is not None:
            seen = group_tokens.setdefault(row.prefix_group, (row.prefix_tokens, number))
            if seen[0] != row.prefix_tokens:
                raise TraceError(f"{where}: prefix_tokens: group {row.prefix_group!r} has {row.prefix_tokens} "
                                 f"here but {seen[0]} on line {seen[1]}")
        rows.append(row)
    if not rows:
        raise TraceError(f"{source}: the trace has no requests")
    return Trace(name, tuple(rows))


def load_trace(path: str | Path) -> Trace:
    """The trace in `path`; its name is `trace-<file stem>` (it seeds the replay, and labels rows)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: the trace is not UTF-8 text") from None
    return parse_trace(text.splitlines(), f"trace-{path.stem}", str(path))
