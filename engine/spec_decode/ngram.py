"""Prompt-lookup (n-gram) drafts: the tokens that followed the context's suffix where it occurred before.

The rule is vLLM's (`vllm/v1/spec_decode/ngram_proposer.py`): take the *longest* suffix of
prompt + output whose length is in `[prompt_lookup_min, prompt_lookup_max]` and which occurred
earlier in the context, and propose the (up to) `k` tokens that followed its *earliest*
occurrence. vLLM rescans the whole context each step (KMP, numba); here each request keeps an index
of its n-grams (one dict per length, n-gram -> earliest start), extended by the tokens added since
its last proposal, so a proposal costs `O(max_n - min_n + 1)` dict lookups whatever the context's
length, and the context is indexed once (O(len) dict inserts on the first proposal).

Drafts are point masses (no draft probabilities), which is what the verification in
`engine.spec_decode.rejection_sampler` assumes. The state lives as long as the `Request` object
(`WeakKeyDictionary`): nothing to forget when a request ends. A request's `token_ids` only grow
(preemption keeps them), so the index stays valid across preemptions.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence


class _Index:
    """One request's n-grams: `by_length[n - min_n][ngram] = earliest start`, over the n-grams
    that end before `end` (the index never holds the context's own suffix)."""

    __slots__ = ("by_length", "end", "__weakref__")

    def __init__(self, num_lengths: int) -> None:
        self.by_length: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_lengths)]
        self.end = 0


class NgramProposer:
    """Drafts by prompt lookup for requests with `token_ids` (see the module docstring)."""

    BULK = 32    # a first index over more tokens than this is built in bulk (`_build`)

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, request, k: int) -> list[int]:
        """Up to `k` draft tokens to follow `request.token_ids` (fewer near the end of a match, none
        without one)."""
        return self.propose_at(request, len(request.token_ids), k)

    def propose_at(self, request, length: int, k: int) -> list[int]:
        """`propose` as if the context were `request.token_ids[:length]` (the shadow drafts of
        `engine.spec_decode.shadow` continue the newest token the host knows, which with async
        scheduling may be one behind the placeholder at the end)."""
        tokens = request.token_ids
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = _Index(self.max_n - self.min_n + 1)
        self._extend(index, tokens, length - 1)
        return self.lookup(index, tokens, k, length)

    def _extend(self, index: _Index, tokens: Sequence[int], end: int) -> None:
        """Index every n-gram that ends at a position in `[index.end, end)`."""
        min_n = self.min_n
        if index.end == 0 and end > self.BULK:
            self._build(index, tokens, end)
            return
        for stop in range(index.end + 1, end + 1):        # the n-gram is tokens[stop - n:stop]
            for j, table in enumerate(index.by_length):
                n = min_n + j
                if stop < n:
                    break
                table.setdefault(tuple(tokens[stop - n:stop]), stop - n)
        index.end = max(index.end, end)

    def _build(self, index: _Index, tokens: Sequence[int], end: int) -> None:
        """`_extend` of an empty index, a context's first proposal (the prompt): the same tables,
        built by `dict` from zipped slices (reversed, so each n-gram keeps its earliest start),
        ~4x faster than an insert per n-gram."""
        head = list(tokens[:end])
        for j in range(len(index.by_length)):
            n = self.min_n + j
            grams = list(zip(*(head[i:end - n + 1 + i] for i in range(n))))   # grams[s]: tokens[s:s + n]
            index.by_length[j] = dict(zip(reversed(grams), range(len(grams) - 1, -1, -1)))
        index.end = end

    def lookup(self, index: _Index, tokens: Sequence[int], k: int, length: int | None = None) -> list[int]:
        """The tokens after the earliest earlier occurrence of the longest suffix n-gram of
        `tokens[:length]` (all of `tokens` by default)."""
        length = len(tokens) if length is None else length
        for j in range(len(index.by_length) - 1, -1, -1):
            n = self.min_n + j
            if n > length:
                continue
            start = index.by_length[j].get(tuple(tokens[length - n:length]))
            if start is not None:
                follow = start + n
                return list(tokens[follow:min(follow + k, length)])
        return []
