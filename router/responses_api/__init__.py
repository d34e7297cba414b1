"""OpenAI's Responses API, stateless (`POST /v1/responses`): `protocol` (the body and its refusals),
`events` (the Response object and its typed stream events), `handler` (the route's work)."""

from router.responses_api.handler import create_response

__all__ = ["create_response"]
