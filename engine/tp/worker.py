"""A tensor-parallel rank other than 0: `python -m engine.tp.worker` (spawned by `engine.tp.launch`).

It builds what rank 0's `Engine` builds, in the same order so the collectives pair up: join the
group, load its share of the weights (only its slices are read from the files), size its KV cache
and agree on the smallest block count, allocate the cache, pack the weights. Then it mirrors
rank 0's steps: wait for a header, receive the staged inputs, run the same forward and the head's
all-gather, and discard the logits (rank 0 samples). It exits on STOP, when rank 0 disappears
(parent watch), or on any error, with a message naming its rank.

Its settings arrive as JSON in `CBSERVE_TP_SPEC` (a `WorkerSpec`), never pickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SPEC_ENV = "CBSERVE_TP_SPEC"
PARENT_POLL_SECONDS = 0.5
log = logging.getLogger("engine.tp.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its share of rank 0's engine (all derived by rank 0)."""

    model_dir: str
    dtype: str                      # "float32" | "float16" | "bfloat16"
    device: str                     # this rank's device ("cpu", "cuda:1", ...)
    max_position: int
    quantization: str | None
    cache: dict                     # engine.config.CacheConfig fields
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    headroom_bytes: int
    size: int
    lora_slots: int = 0             # LoRA: adapter slots (engine/lora/layers.py); 0: off
    lora_rank: int = 0              # their (padded) rank
    rank: int = 0
    store_path: str = ""            # the rendezvous FileStore, in a 0700 directory of rank 0's (tp_launch)
    timeout_s: float = 300.0
    parent_pid: int = 0

    def with_rank(self, rank: int, device: str, store_path: str, timeout_s: float) -> WorkerSpec:
        return dataclasses.replace(self, rank=rank, device=device, store_path=store_path, timeout_s=timeout_s,
                                   parent_pid=os.getpid())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        return cls(**raw)


def _watch_parent(parent_pid: int, rank: int) -> None:
    # Rank 0 gone (killed, crashed): nobody will send another step; do not wait for a timeout.
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    log.error("tensor-parallel rank %d: rank 0 (pid %d) is gone; exiting", rank, parent_pid)
    os._exit(1)


def run(spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist

    from engine.config import CacheConfig
    from engine.dtypes import DTYPES
    from engine.kv_cache import allocate_kv_cache
    from engine.kv_dtype import resolve_kv_cache_dtype
    from engine.kv_groups.spec import cache_groups
    from engine.kv_sizing import ProfileBatch, measure_startup_memory, size_cache
    from engine.loader import load_model
    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner
    from engine.quant import quantize_model
    from engine.sampling.sampler import Sampler
    from engine.tp.comm import CMD_KV_GATHER, CMD_KV_SCATTER, CMD_LORA_SLOT, CMD_STEP, CMD_STOP, TPComm
    from engine.tp.kv import serve_kv_command
    from engine.tp.shard import TPShard

    device, dtype = torch.device(spec.device), DTYPES[spec.dtype]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cache = CacheConfig(**spec.cache)
    startup = measure_startup_memory(cache, device)
    comm = TPComm.init(spec.rank, spec.size, device, dist.FileStore(spec.store_path, spec.size), spec.timeout_s)
    cfg = ModelConfig.from_dir(spec.model_dir)
    model = load_model(Path(spec.model_dir), cfg, dtype, device, spec.max_position,
                       shard=TPShard(cfg, spec.rank, spec.size), comm=comm)
    model.use_kv_groups(cache_groups(cfg.layer_windows, cfg.num_layers, cache.kv_group_windows))  # rank 0's
    if spec.quantization:
        quantize_model(model, spec.quantization, device)
    lora = None
    if spec.lora_slots:   # the same slots as rank 0's, holding this rank's shards
        from engine.lora.layers import attach_lora
        lora = attach_lora(model, spec.lora_slots, spec.lora_rank, TPShard(cfg, spec.rank, spec.size))
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype, device)
    sized = size_cache(cache, model, kv_dtype, device,
                       ProfileBatch.worst_case(spec.max_num_batched_tokens, spec.max_num_seqs, spec.max_model_len),
                       Sampler(spec.eos_token_ids), startup, spec.headroom_bytes)
    num_blocks = comm.min_int(sized.num_blocks)
    kv_cache = allocate_kv_cache(model.cfg, num_blocks, cache.block_size, kv_dtype, device, model.kv_groups.slots)
    runner = ModelRunner(model, kv_cache, cache.block_size, device, max_num_seqs=spec.max_num_seqs,
                         max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=spec.max_model_len,
                         enforce_eager=True)
    log.info("tensor-parallel rank %d/%d ready on %s: %d KV blocks", spec.rank, spec.size, device, num_blocks)
    while True:
        command, layout = comm.recv_header()   # layout: a step's Layout, or a KV command's block count
        if command == CMD_STOP:
            break
        if command == CMD_STEP:
            comm.broadcast_bytes(runner.inputs.reserve(layout.nbytes))
            runner.run_received(layout)
        elif command in (CMD_KV_GATHER, CMD_KV_SCATTER):
            serve_kv_command(comm, command, layout, kv_cache)
        elif command == CMD_LORA_SLOT:
            from engine.lora.manager import serve_lora_command
            serve_lora_command(comm, layout, lora.storage)
    # No destroy_process_group here: it would wait on rank 0, which waits for this process to exit.


def main() -> int:
    spec = WorkerSpec.from_json(os.environ[SPEC_ENV])
    logging.basicConfig(level=os.environ.get("CBSERVE_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(spec.parent_pid, spec.rank), daemon=True).start()
    # Ctrl-C in a terminal reaches the whole process group: rank 0 drains and then stops us (STOP,
    # or its exit); a rank that quit on its own would turn a drain into a lost-rank exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads = os.environ.get("CBSERVE_NUM_THREADS")
    if threads:
        import torch
        torch.set_num_threads(int(threads))
    try:
        run(spec)
    except Exception as e:  # noqa: BLE001 - rank 0's watchdog reports the exit; say why here
        log.exception("tensor-parallel rank %d failed: %s", spec.rank, e)
        return 1
    # STOP: nothing to save. Skip the interpreter's teardown, where the process group's destructor
    # waits seconds on peers that are gone.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
