"""`RequestOutput` as the engine builds it: positionally (`Engine._emit`, once per request per
step), so its first fields keep this order; new fields go after them, with defaults."""

from __future__ import annotations

from dataclasses import MISSING, fields

from engine.engine import Engine, EngineConfig
from engine.outputs import RequestOutput
from engine.sampling.params import SamplingParams

EMITTED = ["request_id", "new_token_ids", "new_logprobs", "text_delta", "finished", "finish_reason",
           "num_prompt_tokens", "num_cached_tokens", "output_token_ids", "text", "first_token_time",
           "arrival_time", "first_scheduled_time", "stop_reason"]


def test_the_emitted_fields_keep_their_order():
    names = [f.name for f in fields(RequestOutput)]
    assert names[:len(EMITTED)] == EMITTED
    assert all(f.default is not MISSING or f.default_factory is not MISSING for f in fields(RequestOutput)[len(EMITTED):])


def test_an_emitted_output_carries_the_request():
    engine = Engine(EngineConfig(model="tiny"))
    req = engine.add_request([1, 5, 9], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    first, last = outputs[0], outputs[-1]
    assert first.request_id == req.request_id and first.num_prompt_tokens == 3 and not first.finished
    assert first.new_logprobs[0] is not None and first.first_token_time is not None
    assert last.finished and last.finish_reason == "length" and last.output_token_ids == req.output_token_ids
    assert len(last.output_token_ids) == 2 and last.arrival_time == req.arrival_time
