"""Schema fuzz of the router's OpenAPI (schemathesis): generated requests never get a 5xx.

A real router (uvicorn on 127.0.0.1) over fake pods runs in a thread. For every operation in its
OpenAPI document (`app.openapi()`, which carries the request bodies' JSON schemas) schemathesis
generates requests that fit the schema (valid shapes: many reach the pods and stream back) and,
for the POST routes, requests that break it (wrong types, out-of-range values, raw bytes). Any
5xx fails; every /v1 error must be OpenAI-shaped. Example counts are bounded so the file stays
well under a minute on a loaded 2-core machine.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from fake_pods import Script
from router_harness import RouterThread

POST_ROUTES = ["/v1/completions", "/v1/chat/completions"]
GET_ROUTES = ["/health", "/ready", "/metrics", "/v1/models"]
# Examples per (route, mode): generation dominates the cost (~0.1 s of CPU per example).
MAX_EXAMPLES = {(GenerationMode.POSITIVE, "POST"): 40, (GenerationMode.NEGATIVE, "POST"): 25,
                (GenerationMode.POSITIVE, "GET"): 5}


@pytest.fixture(scope="module")
def router(tokenizer):
    with RouterThread(tokenizer, prefill=[Script()], decode=[Script()]) as thread:
        yield thread.harness


@pytest.fixture(scope="module")
def tally():
    counts: Counter = Counter()
    yield counts
    streams = counts.pop("streams", 0)
    print(f"\nschema fuzz: {sum(counts.values())} requests, {sum(n for s, n in counts.items() if s >= 500)} 5xx; "
          f"statuses {dict(sorted(counts.items()))}, {streams} SSE streams")


def _fuzz(router, tally: Counter, path: str, method: str, mode: GenerationMode) -> None:
    operation = schemathesis.openapi.from_dict(router.app.openapi())[path][method]

    @settings(max_examples=MAX_EXAMPLES[mode, method], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
    def one(case, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict):
            case.body.pop("model", None)      # else almost every valid body names an unknown model (404)
        response = case.call(base_url=router.url, timeout=60)
        tally[response.status_code] += 1
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        if response.status_code >= 400 and path.startswith("/v1/"):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        if "text/event-stream" in " ".join(response.headers.get("content-type", [])):
            tally["streams"] += 1
            # schemathesis stops reading a long stream at its `max-stream-events`: only a whole
            # stream must end with [DONE].
            assert response.stream_cut_short or response.text.endswith("data: [DONE]\n\n"), response.text[-300:]

    one()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", POST_ROUTES)
def test_post_routes_never_answer_5xx(router, tally, path, mode):
    _fuzz(router, tally, path, "POST", mode)


def test_the_document_lists_every_route_with_its_body_schema(router):
    paths = router.app.openapi()["paths"]
    assert set(POST_ROUTES + GET_ROUTES) <= set(paths)
    for path in POST_ROUTES:
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "$ref" not in str(schema) and {"stop", "stop_token_ids", "n"} <= set(schema["properties"])


@pytest.mark.parametrize("path", GET_ROUTES)
def test_get_routes_never_answer_5xx(router, tally, path):
    _fuzz(router, tally, path, "GET", GenerationMode.POSITIVE)
