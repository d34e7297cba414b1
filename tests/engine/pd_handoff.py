"""P/D inside one process, for engine tests: a prefill-role engine prefills, its held blocks are
copied into the decode-role engine's reserved blocks (as the transfer layer writes them: from
`first_block_in_window(prompt)` on, the blocks a pull moves; with KV groups each group's pages
from its window's start, `kvtransfer.kv_groups`), and the decode engine lands each
request with the prefill engine's first token. With `draft_kv`, the prefill engine's draft model's
blocks are copied into the decode engine's draft cache too, as a pull that ships them writes them
(`kvtransfer.draft_kv`), and the proposer is told (`DraftModelProposer.received`)."""

from __future__ import annotations

from engine.engine import Engine
from engine.sampling.params import SamplingParams


def run_disaggregated(prefill: Engine, decode: Engine, prompts: list[list[int]],
                      params: SamplingParams, copied: dict[str, int] | None = None,
                      draft_kv: bool = False) -> list[list[int]]:
    """Every prompt through `prefill` then `decode`; returns each prompt's output token ids.
    A request's KV lands once the decode engine has reserved its blocks, between its steps;
    `copied` gets each request's number of blocks (pages, with KV groups) moved."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        prefill.add_request(prompt, params, request_id=rid)
        decode.add_request(prompt, params, request_id=rid, remote_kv=True)
    first: dict[str, int] = {}
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            first[o.request_id] = o.new_token_ids[0]
    results: dict[str, list[int]] = {}
    landed = set()
    while decode.has_unfinished_requests():
        for rid in decode.last_schedule.reserved_request_ids if decode.last_schedule else ():
            if rid not in landed:   # KV arrives after a few decode steps of the others
                req = decode.scheduler.get_request(rid)
                kv, source_kv = decode.scheduler.kv_manager, prefill.scheduler.kv_manager
                start, group_starts = kv.pull_starts(req.num_prompt_tokens)
                pairs = list(zip(prefill.scheduler.held[rid].block_ids, req.block_ids))[start:]
                # KV groups: each group's pages from its window's start
                for begin, src, dst in zip(group_starts, source_kv.group_tables(rid), kv.group_tables(rid)):
                    pairs += list(zip(src, dst))[begin:]
                assert all(s and d for s, d in pairs), f"{rid}: a block the pull moves was freed"
                for s, d in pairs:
                    decode.kv_cache[d].copy_(prefill.kv_cache[s])
                    if draft_kv:
                        decode.spec.draft.kv_cache[d].copy_(prefill.draft_prefill.kv_cache[s])
                if copied is not None:
                    copied[rid] = len(pairs)
                results.setdefault(rid, []).extend(decode.land_remote_kv(rid, first[rid]).new_token_ids)
                if draft_kv:
                    decode.spec.draft.received(req)
                landed.add(rid)
        for o in decode.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [results[rid] for rid in ids]
