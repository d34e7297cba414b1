"""Prefix affinity: send a prompt to the prefill pod that recently prefilled the same prefix.

Pods keep a prefix cache of full KV blocks, so a prompt whose leading blocks a pod computed recently
costs only its uncached tail there. The router cannot see the pods' caches; it remembers where it
sent each block hash (chain hashes over full blocks, as the pods key their caches) in a bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from router.load import PodState
from router.policy.base import RoutingRequest


def block_hashes(token_ids: Sequence[int], block_size: int, root: int = 0) -> tuple[int, ...]:
    """Chain hash of every full block: hash i covers tokens [0, (i + 1) * block_size); `root`
    starts the chain (a LoRA adapter's own: `router.lora.state.prefix_root`)."""
    hashes = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class PrefixIndex:
    """Bounded LRU of block hash -> the pod addresses that recently prefilled that block."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._pods_by_hash: OrderedDict[int, set[str]] = OrderedDict()

    def record(self, hashes: Sequence[int], address: str) -> None:
        for h in hashes:
            pods = self._pods_by_hash.get(h)
            if pods is None:
                pods = self._pods_by_hash[h] = set()
            else:
                self._pods_by_hash.move_to_end(h)
            pods.add(address)
        while len(self._pods_by_hash) > self.max_entries:
            self._pods_by_hash.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[int], address: str) -> int:
        """How many leading blocks of the prompt `address` probably holds."""
        matched = 0
        for h in hashes:
            pods = self._pods_by_hash.get(h)
            if pods is None or address not in pods:
                break
            matched += 1
        return matched

    def uncached_tokens(self, request: RoutingRequest, address: str) -> int:
        """The prompt tokens `address` probably has to compute for `request`: all but its cached
        leading blocks, and always the last one (its logits give the first token)."""
        matched = self.matched_blocks(request.block_hashes, address)
        return max(1, request.num_prompt_tokens - matched * request.block_size)

    def __len__(self) -> int:
        return len(self._pods_by_hash)


class PrefixAffinityScorer:
    """Share of the prompt's full blocks that the pod probably has cached."""

    name = "prefix_affinity"

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def score(self, request: RoutingRequest, pods: list[PodState]) -> dict[str, float]:
        if not request.block_hashes:
            return {p.address: 0.0 for p in pods}
        total = len(request.block_hashes)
        return {p.address: self.index.matched_blocks(request.block_hashes, p.address) / total for p in pods}
