"""The router's token path: pod messages of several tokens, one SSE chunk per message, dedup by index,
the P→D hand-over as its own phase, and pre-rendered chunks equal to the generic encoder's."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from fake_pods import Script, expected_tokens
from router import responses as R
from router_harness import running_router

pytestmark = pytest.mark.anyio


async def _stream(h, body: dict) -> list[dict]:
    async with h.http().stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        raw = [line async for line in response.aiter_lines() if line]
    assert raw[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in raw[:-1]]


def _phase_count(metrics: str, phase: str) -> float:
    match = re.search(rf'cbserve_request_phase_seconds_count\{{phase="{phase}",role="router"\}} (\S+)', metrics)
    return float(match.group(1)) if match else 0.0


def _phase_sum(metrics: str, phase: str) -> float:
    return float(re.search(rf'cbserve_request_phase_seconds_sum\{{phase="{phase}",role="router"\}} (\S+)',
                           metrics).group(1))


@pytest.mark.parametrize("pd", [True, False], ids=["pd", "colocated"])
@pytest.mark.parametrize("per_message", [1, 3, 8])
async def test_messages_of_several_tokens_give_one_chunk_each_and_the_same_text(tokenizer, pd, per_message):
    script = Script(tokens_per_message=per_message, first_token_delay=0.05 if pd else 0.0)   # P answers first
    pods = {"prefill": [Script()], "decode": [script]} if pd else {"colocated": [script]}
    async with running_router(tokenizer, **pods) as h:
        body = {"prompt": "abc", "max_tokens": 20, "ignore_eos": True, "stream_options": {"include_usage": True}}
        chunks = await _stream(h, body)
        want = tokenizer.decode(expected_tokens(tokenizer.encode("abc"), 20))
        content = [c for c in chunks if c["choices"]]
        assert "".join(c["choices"][0]["text"] for c in content) == want
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        # One chunk per pod message: P's token, then D's messages (the first trimmed of token 0,
        # dropped when that was all it had).
        num_messages = -(-20 // per_message)
        assert len(content) == (1 + num_messages - (per_message == 1) if pd else num_messages)
        del body["stream_options"]                       # only allowed with stream: true
        whole = (await h.http().post("/v1/completions", json=body)).json()
        assert whole["choices"][0]["text"] == want and whole["usage"]["completion_tokens"] == 20


async def test_n_choices_merge_with_several_tokens_per_message(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(tokens_per_message=4)]) as h:
        chunks = await _stream(h, {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 10, "ignore_eos": True,
                                   "stream_options": {"include_usage": True}})
        texts = ["", "", "", ""]
        for chunk in chunks:
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice["text"]
        assert texts == [tokenizer.decode(expected_tokens(tokenizer.encode(p), 10)) for p in ("ab", "ab", "cd", "cd")]
        assert chunks[-1]["usage"]["completion_tokens"] == 40


async def test_stop_string_inside_a_message_cuts_exactly_and_cancels_the_pod(tokenizer):
    prompt = tokenizer.encode("abc")
    full = tokenizer.decode(expected_tokens(prompt, 40))
    stop = full[10:12]
    cut = full[: full.index(stop)]
    async with running_router(tokenizer, colocated=[Script(tokens_per_message=8, token_delay=0.05)]) as h:
        chunks = await _stream(h, {"prompt": "abc", "max_tokens": 40, "stop": [stop]})
        assert "".join(c["choices"][0]["text"] for c in chunks) == cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        await asyncio.wait_for(h.colocated[0].records.cancel_seen.wait(), 5.0)


async def test_pd_gap_is_its_own_phase_and_part_of_tpot(tokenizer):
    # P answers at once; D's first message comes 0.3 s later (a slow KV pull).
    async with running_router(tokenizer, prefill=[Script()], decode=[Script(first_token_delay=0.3)]) as h:
        response = await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        assert response.status_code == 200
        metrics = (await h.http().get("/metrics")).text
        assert _phase_count(metrics, "pd_gap") == 1.0
        gap = _phase_sum(metrics, "pd_gap")
        assert 0.25 < gap < 2.0
        tpot = float(re.search(r'cbserve_time_per_output_token_seconds_sum\{role="router"\} (\S+)', metrics).group(1))
        assert tpot >= gap / 3           # the client's TPOT counts the hand-over (3 gaps after token 1)
        assert _phase_sum(metrics, "decode") >= gap


async def test_no_pd_gap_without_a_prefill_pod_or_when_d_speaks_first(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        assert (await h.http().post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})).status_code == 200
        assert _phase_count((await h.http().get("/metrics")).text, "pd_gap") == 0.0
    # D's stream (with token 0) arrives before P's answer: nothing is repeated, no hand-over gap.
    async with running_router(tokenizer, prefill=[Script(first_token_delay=0.3)],
                              decode=[Script(tokens_per_message=2, token_delay=0.1)]) as h:
        chunks = await _stream(h, {"prompt": "abc", "max_tokens": 12, "ignore_eos": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(
            expected_tokens(tokenizer.encode("abc"), 12))
        assert len(chunks) == 6
        metrics = (await h.http().get("/metrics")).text
        assert _phase_count(metrics, "pd_gap") == 0.0
        assert _phase_count(metrics, "prefill") == 1.0      # P's late answer still fills the trace


@pytest.mark.parametrize("text", ["", "plain", 'q"uote\\', "é ü 😀", "\n\t\x00\x1f", "\u2028\u2029", "\ufffd"])
def test_template_chunk_equals_the_generic_encoding(text):
    def body(t):
        return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m/é",
                "choices": [{"index": 2, "text": t, "logprobs": None, "finish_reason": None}], "usage": None}
    assert R.sse_template(body(R.TEXT))(text) == R.sse(body(text))
