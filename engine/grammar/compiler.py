"""`GrammarCompiler`: every spec compiled once, off the engine thread, kept in an LRU.

Compiles run on a small thread pool (llguidance drops the GIL while it builds a grammar), so a
request's compile overlaps its own prefill and never runs on the engine thread. The cache maps a
spec's `key` to the *future* of its compile: a second request for the same schema or tool list
(or the other `n - 1` choices of one request) shares the compile in flight, and a repeated spec
costs a dict lookup. A failed compile is cached too (it is deterministic). One compiler serves
one backend, so one tokenizer: the backend's `tokenizer_hash` is in every fingerprint.

Thread-safe: a pod's event loop starts compiles as requests arrive (before the engine thread
sees them), the engine thread reads them. The backend itself (its token table, ~1 s for a 128k
vocabulary) is built as the pool's first task, so engine start-up does not wait for it.

`fingerprint(spec)` names what a prefill pod sampled under: backend, its version, the spec, the
token table and the logits width. A decode pod continues from a prefill pod's first token only
when its own fingerprint is the same (`engine.grammar.structured_outputs`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from engine.grammar.backend import CompiledGrammar, GrammarBackend, GrammarCompileError
from engine.grammar.spec import StructuredSpec

DEFAULT_CACHE_SIZE = 512


@dataclass
class CompileStats:
    """Counts since the last `take_stats` (the pods turn them into Prometheus metrics)."""

    compile_seconds: list[float] = field(default_factory=list)   # one per compile (cache miss)
    cache_hits: int = 0


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend], cache_size: int = DEFAULT_CACHE_SIZE,
                 max_workers: int = 2) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._backend: Future[GrammarBackend] = self._pool.submit(make_backend)
        self._ready: GrammarBackend | None = None   # the backend once built (read every step)
        self._cache: collections.OrderedDict[str, Future[CompiledGrammar]] = collections.OrderedDict()
        self._fingerprints: dict[str, str] = {}   # spec key -> fingerprint, for the cached specs
        self._lock = threading.Lock()
        self._stats = CompileStats()

    def compile(self, spec: StructuredSpec) -> Future[CompiledGrammar]:
        """The compile of `spec`: started now unless cached (or under way); never blocks."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._stats.cache_hits += 1
                return future
            future = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > self.cache_size:   # holders of an evicted future keep it
                self._fingerprints.pop(self._cache.popitem(last=False)[0], None)
            return future

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        try:
            backend = self._backend.result()
        except Exception as e:  # noqa: BLE001 - every compile says why there is no backend
            raise GrammarCompileError(f"structured outputs are unavailable: the grammar backend failed "
                                      f"to start: {e}") from e
        started = time.perf_counter()
        try:
            return backend.compile(spec)
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                self._stats.compile_seconds.append(seconds)

    @property
    def backend(self) -> GrammarBackend:
        """The backend (waits for its token table on first use)."""
        backend = self._ready
        if backend is None:   # a Future's result() takes its lock: once is enough
            backend = self._ready = self._backend.result()
        return backend

    def fingerprint(self, spec: StructuredSpec) -> str:
        """sha256 of (backend, version, spec key, token table hash, logits width); a dict lookup
        for a cached spec (it is read on the engine thread for every first token of P/D)."""
        key = spec.key
        fingerprint = self._fingerprints.get(key)
        if fingerprint is None:
            b = self.backend
            fingerprint = hashlib.sha256(json.dumps([b.name, b.version, key, b.tokenizer_hash, b.vocab_width])
                                         .encode()).hexdigest()
            with self._lock:
                if key in self._cache:
                    self._fingerprints[key] = fingerprint
        return fingerprint

    def take_stats(self) -> CompileStats:
        """What happened since the last call."""
        with self._lock:
            stats, self._stats = self._stats, CompileStats()
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
