"""Request traces: validated line by line with errors naming the line and the field; replayed with
exact lengths, shared prefixes and the benchmark's seeded Poisson arrivals."""

from __future__ import annotations

import json

import pytest

from bench.goodput import cluster_spec, parse_args
from cbserve.goodput.configs import parse_config
from cbserve.goodput.trace import TraceError, load_trace, parse_trace
from engine.tokenizer import Tokenizer, build_byte_level_tokenizer


def _lines(*rows) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in rows]


@pytest.mark.parametrize("line, message", [
    ('{"prompt_tokens": 10', "t.jsonl:2: not JSON"),
    ('[1, 2]', "t.jsonl:2: each line must be a JSON object"),
    ('{"output_tokens": 5}', "t.jsonl:2: prompt_tokens is required"),
    ('{"prompt_tokens": 10}', "t.jsonl:2: output_tokens is required"),
    ('{"prompt_tokens": "10", "output_tokens": 5}', 't.jsonl:2: prompt_tokens must be an integer, got "10"'),
    ('{"prompt_tokens": 10.5, "output_tokens": 5}', "t.jsonl:2: prompt_tokens must be an integer, got 10.5"),
    ('{"prompt_tokens": true, "output_tokens": 5}', "t.jsonl:2: prompt_tokens must be an integer, got true"),
    ('{"prompt_tokens": 1, "output_tokens": 5}', "t.jsonl:2: prompt_tokens must be >= 2, got 1"),
    ('{"prompt_tokens": 10, "output_tokens": 0}', "t.jsonl:2: output_tokens must be >= 1, got 0"),
    ('{"prompt_tokens": 10, "output_tokens": 5, "promt": 3}', "t.jsonl:2: unknown field 'promt'"),
    ('{"prompt_tokens": 10, "output_tokens": 5, "prefix_group": "a"}',
     "t.jsonl:2: prefix_tokens is required with prefix_group"),
    ('{"prompt_tokens": 10, "output_tokens": 5, "prefix_tokens": 4}',
     "t.jsonl:2: prefix_group is required with prefix_tokens"),
    ('{"prompt_tokens": 10, "output_tokens": 5, "prefix_group": "a", "prefix_tokens": 10}',
     "t.jsonl:2: prefix_tokens (10) must be < prompt_tokens (10)"),
    ('{"prompt_tokens": 10, "output_tokens": 5, "prefix_group": [1], "prefix_tokens": 4}',
     "t.jsonl:2: prefix_group must be a non-empty string or an integer"),
    ('{"prompt_tokens": 10, "output_tokens": 5, "prefix_group": "g", "prefix_tokens": 6}',
     "t.jsonl:2: prefix_tokens: group 'g' has 6 here but 4 on line 1"),
])
def test_bad_lines_name_the_line_and_the_field(line, message):
    first = '{"prompt_tokens": 10, "output_tokens": 5, "prefix_group": "g", "prefix_tokens": 4}'
    with pytest.raises(TraceError) as info:
        parse_trace([first, line], "t", "t.jsonl")
    assert str(info.value).startswith(message)


def test_empty_and_unreadable_traces(tmp_path):
    with pytest.raises(TraceError, match="has no requests"):
        parse_trace(["", "  "], "t", "t.jsonl")
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(tmp_path / "bin.jsonl")


def test_replay_has_exact_lengths_shared_prefixes_and_seeded_arrivals(tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text("\n".join(_lines(
        {"prompt_tokens": 40, "output_tokens": 7},
        {"prompt_tokens": 300, "output_tokens": 20, "prefix_group": "doc", "prefix_tokens": 257},
        {"prompt_tokens": 280, "output_tokens": 3, "prefix_group": "doc", "prefix_tokens": 257},
        {"prompt_tokens": 90, "output_tokens": 1, "prefix_group": 7, "prefix_tokens": 33},
    )) + "\n\n")
    trace = load_trace(path)
    assert trace.name == "trace-traffic" and trace.prefix_caching and trace.max_total_tokens == 320
    tokenizer = Tokenizer.from_pretrained(build_byte_level_tokenizer(tmp_path / "tok"))
    requests = trace.requests(4.0, 10.0, seed=0)
    assert len(requests) == 40 and requests == trace.requests(4.0, 10.0, seed=0)
    assert requests != trace.requests(4.0, 10.0, seed=1)
    assert all(a.arrival_s <= b.arrival_s < 10.0 for a, b in zip(requests, requests[1:]))
    order = trace.order(0)
    by_shape = {(r.prompt_tokens, r.output_tokens): r for r in trace.rows}
    prefix_of: dict[str, str] = {}
    for i, request in enumerate(requests):
        row = trace.rows[order[i % 4]]
        assert len(tokenizer.encode(request.prompt)) == row.prompt_tokens       # bos + one token per byte
        assert request.max_tokens == row.output_tokens and request.cancel_after_tokens is None
        assert by_shape[(row.prompt_tokens, row.output_tokens)] is row
        if row.prefix_group is not None:
            prefix = request.prompt[:row.prefix_tokens - 1]
            assert prefix_of.setdefault(row.prefix_group, prefix) == prefix      # the group's shared text
    assert len(set(prefix_of.values())) == 2
    # A higher rate replays a longer stretch of the same order.
    assert [r.max_tokens for r in trace.requests(8.0, 10.0, seed=0)[:8]] == [r.max_tokens for r in requests[:8]]
    warmup = trace.warmup(0, 1)
    assert len(warmup) == 2 and {w.prompt[:32] for w in warmup} == {p[:32] for p in prefix_of.values()}


def test_goodput_takes_a_trace_and_xpyd_configurations():
    args = parse_args(["--trace", "t.jsonl", "--configs", "2P3D", "colocated-4-round-robin"])
    assert args.trace == "t.jsonl" and args.configs == ["2P3D", "colocated-4-round-robin"]
    trace = parse_trace(_lines({"prompt_tokens": 10, "output_tokens": 5}), "t")
    spec = cluster_spec(args, "2P3D", trace)
    assert (spec.num_prefill, spec.num_decode, spec.policy, spec.prefix_caching) == (2, 3, "goodput", False)
    assert parse_config("colocated-4-round-robin") == {"num_colocated": 4, "policy": "round_robin"}
    assert parse_config("pd-round-robin") == {"num_prefill": 1, "num_decode": 1, "policy": "round_robin"}
    for bad in ("3X", "0P1D", "colocated-0", "1P1D-fastest"):
        with pytest.raises(ValueError, match=bad):
            parse_config(bad)
    with pytest.raises(SystemExit):
        parse_args(["--configs", "1P0D"])
