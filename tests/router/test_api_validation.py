"""Bad input is a 4xx in OpenAI's error shape, and no pod ever sees the request."""

from __future__ import annotations

import pytest

from fake_pods import Script
from router_harness import running_router

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "x" * 300     # the fake pods' max_model_len is 256; one byte-level token per byte

# (name, path, body (dict or raw bytes), headers, status, param)
CASES = [
    ("invalid json", COMPLETIONS, b'{"model": "fake-model", "prompt": ', {}, 400, None),
    ("json array body", COMPLETIONS, b"[1, 2]", {}, 400, None),
    ("missing prompt", COMPLETIONS, {"model": "fake-model"}, {}, 400, "prompt"),
    ("prompt wrong type", COMPLETIONS, {"model": "fake-model", "prompt": 5}, {}, 400, "prompt"),
    ("max_tokens as string", COMPLETIONS, {"prompt": "a", "max_tokens": "7"}, {}, 400, "max_tokens"),
    ("temperature as string", CHAT, {"messages": MESSAGES, "temperature": "hot"}, {}, 400, "temperature"),
    ("stream not bool", CHAT, {"messages": MESSAGES, "stream": "yes"}, {}, 400, "stream"),
    ("temperature too high", COMPLETIONS, {"prompt": "a", "temperature": 1000}, {}, 400, "temperature"),
    ("negative temperature", CHAT, {"messages": MESSAGES, "temperature": -0.1}, {}, 400, "temperature"),
    ("top_p zero", COMPLETIONS, {"prompt": "a", "top_p": 0}, {}, 400, "top_p"),
    ("top_k below -1", COMPLETIONS, {"prompt": "a", "top_k": -2}, {}, 400, "top_k"),
    ("min_p above 1", CHAT, {"messages": MESSAGES, "min_p": 1.5}, {}, 400, "min_p"),
    ("presence_penalty out of range", CHAT, {"messages": MESSAGES, "presence_penalty": 3}, {}, 400,
     "presence_penalty"),
    ("repetition_penalty zero", COMPLETIONS, {"prompt": "a", "repetition_penalty": 0}, {}, 400,
     "repetition_penalty"),
    ("max_tokens zero", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("min_tokens above max_tokens", COMPLETIONS, {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, {}, 400,
     "min_tokens"),
    ("n zero", COMPLETIONS, {"prompt": "a", "n": 0}, {}, 400, "n"),
    ("logprobs too many", COMPLETIONS, {"prompt": "a", "logprobs": 50}, {}, 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MESSAGES, "top_logprobs": 2}, {}, 400, "top_logprobs"),
    ("seed too large", COMPLETIONS, {"prompt": "a", "seed": 1 << 70}, {}, 400, "seed"),
    ("empty stop string", COMPLETIONS, {"prompt": "a", "stop": [""]}, {}, 400, "stop"),
    ("negative stop token id", COMPLETIONS, {"prompt": "a", "stop_token_ids": [-1]}, {}, 400, "stop_token_ids"),
    ("empty messages", CHAT, {"messages": []}, {}, 400, "messages"),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}, {}, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages"),
    ("empty token-id prompt", COMPLETIONS, {"prompt": [[]]}, {}, 400, "prompt"),
    ("empty prompt list", COMPLETIONS, {"prompt": []}, {}, 400, "prompt"),
    ("token id out of vocab", COMPLETIONS, {"prompt": [1, 99999]}, {}, 400, "prompt"),
    ("prompt over context length", COMPLETIONS, {"prompt": LONG_PROMPT}, {}, 400, "prompt"),
    ("prompt + max_tokens over context", COMPLETIONS, {"prompt": "x" * 200, "max_tokens": 100}, {}, 400,
     "max_tokens"),
    ("chat over context length", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, {}, 400,
     "messages"),
    ("chat max_completion_tokens over context", CHAT, {"messages": MESSAGES, "max_completion_tokens": 1000}, {},
     400, "max_completion_tokens"),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "a"}, {}, 404, None),
    ("logit_bias unsupported", COMPLETIONS, {"prompt": "a", "logit_bias": {"5": 1.0}}, {}, 400, "logit_bias"),
    ("top_logprobs too many", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, {}, 400,
     "top_logprobs"),
    ("chat max_completion_tokens zero", CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, {}, 400,
     "max_completion_tokens"),
    ("priority beyond int32", COMPLETIONS, {"prompt": "a", "priority": 1 << 40}, {}, 400, "priority"),
    ("n above limit", CHAT, {"messages": MESSAGES, "n": 1000}, {}, 400, "n"),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, {}, 400, "messages"),
    ("bad SLO header", COMPLETIONS, {"prompt": "a"}, {"x-slo-ttft-ms": "soon"}, 400, "x-slo-ttft-ms"),
    # Caps on every list, and fields checked against the model (issue 11, cases 1 and 10).
    ("stream_options without stream", COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, {},
     400, "stream_options"),
    ("chat stream_options with stream false", CHAT,
     {"messages": MESSAGES, "stream": False, "stream_options": {"include_usage": True}}, {}, 400, "stream_options"),
    ("stop token id outside the vocabulary", COMPLETIONS, {"prompt": "a", "stop_token_ids": [7, 260]}, {}, 400,
     "stop_token_ids"),
    ("100,000 stop token ids", CHAT, {"messages": MESSAGES, "stop_token_ids": list(range(100_000))}, {}, 400,
     "stop_token_ids"),
    ("too many stop strings", COMPLETIONS, {"prompt": "a", "stop": ["s"] * 17}, {}, 400, "stop"),
    ("too many prompts", COMPLETIONS, {"prompt": ["a"] * 65}, {}, 400, "prompt"),
    ("too many token-id prompts", COMPLETIONS, {"prompt": [[5]] * 65}, {}, 400, "prompt"),
    ("too many token ids", COMPLETIONS, {"prompt": [5] * ((1 << 20) + 1)}, {}, 400, "prompt"),
    ("token-id prompt over context", COMPLETIONS, {"prompt": [5] * 300}, {}, 400, "prompt"),
    ("too many messages", CHAT, {"messages": MESSAGES * 4097}, {}, 400, "messages"),
    ("too many content parts", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]}, {}, 400, "messages"),
    ("too many logit_bias entries", COMPLETIONS, {"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}},
     {}, 400, "logit_bias"),
    ("tool without its function", CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, {}, 400, "tools"),
    ("too many tools", CHAT, {"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, {}, 400, "tools"),
    ("prompt over the character bound", COMPLETIONS, {"prompt": "x" * 100_000}, {}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
async def test_bad_request_is_openai_error_and_reaches_no_pod(tokenizer, name, path, body, headers, status, param):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()]) as h:
        client = h.http()
        kwargs = {"content": body, "headers": {"content-type": "application/json", **headers}} \
            if isinstance(body, bytes) else {"json": {"model": "fake-model", **body}, "headers": headers}
        if isinstance(body, dict) and "model" in body:
            kwargs["json"] = body
        response = await client.post(path, **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and isinstance(error["type"], str)
        assert error["param"] == param
        assert h.num_pod_requests() == 0


async def test_api_key_required_on_every_v1_route(tokenizer):
    async with running_router(tokenizer, prefill=[Script()], decode=[Script()], api_key="s3cret") as h:
        client = h.http()
        for method, path in (("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT)):
            for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                response = await client.request(method, path, json={"prompt": "a"}, headers=auth)
                assert response.status_code == 401
                assert response.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/health")).status_code == 200      # probes need no key
        ok = await client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 2},
                               headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert h.num_pod_requests() == 2                              # only the authorised request


async def test_models_health_ready_metrics(tokenizer):
    async with running_router(tokenizer, colocated=[Script()]) as h:
        client = h.http()
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "fake-model"
        assert models["data"][0]["max_model_len"] == 256              # from the pod's Handshake
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/ready")).status_code == 200
        await client.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 3})
        text = (await client.get("/metrics")).text
        assert 'cbserve_time_to_first_token_seconds_count{role="router"} 1.0' in text
        assert 'cbserve_requests_total{role="router",status="success"} 1.0' in text
        assert 'cbserve_request_phase_seconds_count{phase="router_queue",role="router"} 1.0' in text
        h.state.draining = True
        assert (await client.get("/ready")).status_code == 503
