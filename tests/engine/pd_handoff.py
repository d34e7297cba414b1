"""P/D inside one process, for engine tests: a prefill-role engine prefills, its held blocks are
copied into the decode-role engine's reserved blocks (as the transfer layer writes them), and the
decode engine lands each request with the prefill engine's first token."""

from __future__ import annotations

from engine.engine import Engine
from engine.sampling_params import SamplingParams


def run_disaggregated(prefill: Engine, decode: Engine, prompts: list[list[int]],
                      params: SamplingParams) -> list[list[int]]:
    """Every prompt through `prefill` then `decode`; returns each prompt's output token ids.
    A request's KV lands once the decode engine has reserved its blocks, between its steps."""
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
                for s, d in zip(prefill.scheduler.held[rid].block_ids, req.block_ids):
                    decode.kv_cache[d].copy_(prefill.kv_cache[s])
                results.setdefault(rid, []).extend(decode.land_remote_kv(rid, first[rid]).new_token_ids)
                landed.add(rid)
        for o in decode.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [results[rid] for rid in ids]
