"""Fixtures for router tests: a byte-level tokenizer, and async tests on asyncio (anyio plugin)."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer, build_byte_level_tokenizer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_byte_level_tokenizer(tmp_path_factory.mktemp("tokenizer")))
