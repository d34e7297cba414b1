"""`Engine`: one loop shared by the prefill, decode and colocated roles.

The step reads as the design says: `out = scheduler.schedule(); logits = runner.run(out);
scheduler.update(out, sampled)`. Everything role-specific happens at the edges: a prefill engine's
requests end after their first token with their blocks held for a pull; a decode engine's
requests arrive with blocks reserved and their KV written by the transfer layer
(`import_remote_kv`). The engine is single-threaded: pods call it from their engine thread only.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import torch

from engine.config import QUANTIZATIONS, CacheConfig, SchedulerConfig
from engine.cuda_graphs import graph_memory_estimate, wants_decode_graphs
from engine.detokenizer import IncrementalDetokenizer
from engine.dtypes import DTYPES
from engine.fp8_checkpoint import load_fp8_model, read_fp8_config, resolve_quantization
from engine.grammar.mask import GrammarMask
from engine.grammar.structured_outputs import StructuredOutputs
from engine.kv_cache import allocate_kv_cache
from engine.kv_groups.spec import serving_cache
from engine.kv_dtype import FP8_KV_DTYPE, kv_scales_suffix, resolve_kv_cache_dtype
from engine.kv_sizing import ProfileBatch, headroom_bytes, measure_startup_memory, size_cache
from engine.loader import load_model, model_fingerprint
from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, PrevSample
from engine.outputs import EngineStats, RequestOutput, StepSample
from engine.presets import resolve_model_dir
from engine.progress import progress
from engine.prompt_logprobs import PromptLogprobs, PromptLogprobsTracker
from engine.quant import quantize_model
from engine.request import Request, RequestStatus
from engine.runner.inference import inference_mode
from engine.sampling.sampler import DeviceSample, Sampler, TokenLogprobs
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import ROLES, Scheduler
from engine.scheduling.output import sampled_requests
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.decoder import SpecDecoder
from engine.spec_decode.draft_prefill import DraftPrefill
from engine.spec_decode.verify_graphs import VerifyBuckets, verify_shape
from engine.step_outputs import StepOutputs, other_rows, split
from engine.telemetry.step_stats import StepStats, StepTrace
from engine.tokenizer import Tokenizer
from engine.tp.kv import TPKVBlocks
from engine.tp.launch import TPDriver
from engine.tp.shard import TensorParallelError, TPShard, check_divisible
from engine.tp.worker import WorkerSpec

log = logging.getLogger(__name__)
_OUTPUTS, _REQUEST_ID, _LAST = operator.attrgetter("output_token_ids"), operator.attrgetter("request_id"), \
    operator.itemgetter(-1)


class _InFlight(NamedTuple):   # (a NamedTuple: built every step, ~3x cheaper than a frozen dataclass)
    """A launched step whose sampled ids are still on the device (async scheduling)."""

    requests: list[Request]   # those that got a placeholder in update(), in batch order
    sample: DeviceSample
    device: PrevSample        # the ids, and each request's row among them


class EngineRequestError(ValueError):
    """A request the engine cannot take (bad prompt, too long, unknown tokens); nothing is queued."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    role: str = "colocated"
    device: str = "cpu"
    dtype: str | None = None            # None: float32 on CPU, the checkpoint's dtype on CUDA
    max_model_len: int | None = None    # None: the model's
    quantization: str | None = None     # "int8": W8A8 linears on CPU (engine/quant.py); "fp8": e4m3
                                        # linears (engine/fp8.py; FP8 checkpoints imply it); None: none
    enforce_eager: bool = False         # True: no CUDA graphs for decode steps
    tensor_parallel_size: int = 1       # ranks (processes, one device each) that split the model
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: on CUDA, off on CPU
    detokenize: bool = True             # False: text only for requests with stop strings (pods: the
                                        # router detokenizes; the engine must, to stop on a string)
    speculative: SpeculativeConfig | None = None   # --speculative-config (engine/spec_decode/)
    lora: LoRAConfig | None = None      # multi-LoRA (--enable-lora; engine/lora/); None: off
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.speculative is not None:
            self.speculative.check_tensor_parallel(self.tensor_parallel_size)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.role = config.role
        self.model_dir: Path = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)   # streams, events, graph pools: this device's
        self.decode_graphs = wants_decode_graphs(self.device, self.role, config.enforce_eager,
                                                 config.tensor_parallel_size)
        dtype_name = config.dtype or ("float32" if self.device.type == "cpu" else self.model_config.torch_dtype)
        self.dtype = DTYPES[dtype_name]
        max_len = min(config.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=max_len)
        # A mixed local/global model: a block table per KV group (engine/kv_groups/); every layer
        # windowed (Mistral): the scheduler frees the blocks behind the window.
        kv_groups, cache = serving_cache(config.cache, self.model_config.layer_windows, self.model_config.num_layers,
                                         self.role, config.speculative is not None)
        self.config = config = dataclasses.replace(config, cache=cache)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.device)
        # KV sized from device memory (CUDA): free memory now, before the weights take theirs.
        startup_memory = measure_startup_memory(config.cache, self.device)

        self.tokenizer = self._load_tokenizer()
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.model_config.eos_token_ids
        self.eos_token_ids = eos or self.model_config.eos_token_ids
        fp8_checkpoint = read_fp8_config(self.model_dir)       # None unless stored in FP8
        self.quantization = resolve_quantization(config.quantization, fp8_checkpoint)
        if fp8_checkpoint is not None and config.tensor_parallel_size > 1:
            raise TensorParallelError("tensor parallelism does not load FP8 checkpoints yet (their scales are "
                                      "not sharded): serve the bf16 checkpoint with --quantization fp8")
        self.tp = self._launch_tensor_parallel(config, dtype_name, max_len, sched_cfg)
        if fp8_checkpoint is not None:
            self.model = load_fp8_model(self.model_dir, self.model_config, fp8_checkpoint, self.dtype, self.device,
                                        max_len + 1)
        else:
            shard = TPShard(self.model_config, 0, config.tensor_parallel_size)
            self.model = load_model(self.model_dir, self.model_config, self.dtype, self.device, max_len + 1,
                                    shard=shard, comm=None if self.tp is None else self.tp.comm)
        self.model.use_kv_groups(kv_groups)
        self.fingerprint = model_fingerprint(self.model_dir)
        if self.quantization:
            if fp8_checkpoint is None:
                quantize_model(self.model, self.quantization, self.device)
            # A quantized model computes other K/V than the plain one: pods must not pair across.
            self.fingerprint += f"+{self.quantization}"
        if self.kv_dtype is FP8_KV_DTYPE:  # pods exchanging fp8 KV must dequantize with the same scales
            self.fingerprint += kv_scales_suffix(self.model)
        # Before sizing: a draft model's weights take memory the KV cache must leave it.
        self.spec = SpecDecoder.create(config.speculative, self.role, self.model_dir, self.model_config, self.dtype,
                                       self.device, max_len, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens)
        # A prefill engine given a draft model computes the draft's KV of every prompt, for the decode pod.
        self.draft_prefill = DraftPrefill.create(config.speculative, self.role, self.model_dir, self.model_config,
                                                 self.dtype, self.device, max_len, sched_cfg.max_num_seqs,
                                                 sched_cfg.max_num_batched_tokens)
        # Adapter slots before the KV cache is sized: their memory is the model's, fixed at start.
        self.lora = None
        if config.lora is not None:
            from engine.lora.manager import LoRAManager
            self.lora = LoRAManager(config.lora, self.model, self.model_config, self.tp)
        # After loading: on CUDA the cache takes what the weights and one worst-case step leave.
        cache_cfg = size_cache(config.cache, self.model, self.kv_dtype, self.device,
                               ProfileBatch.worst_case(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs *
                                                       (1 + (config.speculative.num_speculative_tokens
                                                             if self.spec else 0)), max_len),
                               Sampler(self.eos_token_ids), startup_memory,
                               headroom_bytes(self._graph_memory_estimate(config, sched_cfg)))
        # A draft model's KV has the same blocks: both caches share the memory.
        for draft in (self.spec, self.draft_prefill):
            if draft is not None:
                cache_cfg = draft.fit_cache(cache_cfg, config.cache, self.model.cfg, self.kv_dtype)
        if self.tp is not None:   # each rank sized its own cache: all keep the smallest
            cache_cfg = dataclasses.replace(cache_cfg, num_blocks=self.tp.comm.min_int(cache_cfg.num_blocks))
        self.scheduler_config, self.cache_config = sched_cfg, cache_cfg
        # model.cfg: this rank's share of the heads under tensor parallelism (the whole model otherwise).
        self.kv_cache = allocate_kv_cache(self.model.cfg, cache_cfg.num_blocks, cache_cfg.block_size,
                                          self.kv_dtype, self.device, kv_groups.slots)
        for draft in (self.spec, self.draft_prefill):
            if draft is not None:
                draft.allocate(cache_cfg.num_blocks, cache_cfg.block_size)
        # Tensor parallel: whole-model KV blocks for P/D transfers, gathered from / scattered to the ranks.
        self.tp_kv = None if self.tp is None else TPKVBlocks(self.tp, self.kv_cache, self.model_config)
        self.runner = ModelRunner(self.model, self.kv_cache, cache_cfg.block_size, self.device,
                                  max_num_seqs=sched_cfg.max_num_seqs,
                                  max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                                  max_model_len=max_len, enforce_eager=None if self.decode_graphs else True,
                                  tp=self.tp, lora_slot_of=None if self.lora is None else self.lora.slots.slot_of_request,
                                  hidden_sink=None if self.spec is None else self.spec.hidden_sink,
                                  verify=self._verify_shape(sched_cfg))
        self.runner.warm_up()               # every kernel variant compiled now, not while serving
        self.runner.capture_cuda_graphs()
        # The prefill role ends a request at its first token: there is no next step to overlap.
        self.async_scheduling = self.role != "prefill" and (
            self.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling)
        self._in_flight: _InFlight | None = None
        self.sampler = Sampler(self.eos_token_ids)
        # Constrained decoding: grammars compile off this thread; masks are filled here (rank 0).
        self.structured = StructuredOutputs.for_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                          self.eos_token_ids, self.device)
        self.failed: dict[str, Exception] = {}   # requests ended by an error since `take_failures`
        self.scheduler = Scheduler(sched_cfg, cache_cfg, role=self.role, eos_token_ids=self.eos_token_ids,
                                   lora_slots=None if self.lora is None else self.lora.slots)
        self.scheduler.decode_columns = self.async_scheduling   # steady decodes as columns (engine.decode_columns)
        if self.scheduler.kv_manager.groups is not None:
            self.runner.read_group_tables(self.scheduler.kv_manager.groups.tables)
            log.info("KV cache: %s", kv_groups.describe())
        if self.spec is not None:   # an EAGLE head reads the target's embedding, head and batch order
            self.spec.attach(self.model, self.scheduler)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.prompt_logprobs = PromptLogprobsTracker()
        self._ids = itertools.count()
        self.step_stats = StepStats(trace=StepTrace.from_env(self.role))
        self.last_schedule = None  # the last step's SchedulerOutput (pods read reserved ids from it)
        log.info("engine ready: role=%s model=%s dtype=%s quantization=%s kv_cache_dtype=%s "
                 "tensor_parallel_size=%d blocks=%d x %d", self.role, config.model, dtype_name,
                 self.quantization or "none", str(self.kv_dtype).removeprefix("torch."),
                 config.tensor_parallel_size, cache_cfg.num_blocks, cache_cfg.block_size)

    def _graph_memory_estimate(self, config: EngineConfig, sched_cfg: SchedulerConfig) -> int:
        """What the decode CUDA graphs will take after the KV cache is sized (0 without graphs)."""
        if not self.decode_graphs:
            return 0
        cfg, verify = self.model_config, self._verify_shape(sched_cfg)
        rows = min(sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens)
        return graph_memory_estimate(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                                     max(rows, VerifyBuckets.logits_rows(*verify) if verify else 0), self.dtype.itemsize)

    def _verify_shape(self, sched_cfg: SchedulerConfig) -> tuple[int, int] | None:
        """Speculative verification graphs' (draft width, largest batch): `engine.spec_decode.verify_graphs`."""
        if self.spec is None:
            return None
        return verify_shape(self.spec.config, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens)

    def _launch_tensor_parallel(self, config: EngineConfig, dtype_name: str, max_len: int,
                                sched_cfg: SchedulerConfig) -> TPDriver | None:
        """Tensor parallel: start ranks 1..N-1 (they load their shares while this rank loads its
        own) and join them; None at one rank. Refuses a model that does not split evenly."""
        size = config.tensor_parallel_size
        check_divisible(self.model_config, size)
        if size == 1:
            return None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)   # NCCL binds rank 0 to this GPU
        spec = WorkerSpec(
            model_dir=str(self.model_dir), dtype=dtype_name, device=str(self.device), max_position=max_len + 1,
            quantization=self.quantization, cache=dataclasses.asdict(config.cache),
            max_num_batched_tokens=sched_cfg.max_num_batched_tokens, max_num_seqs=sched_cfg.max_num_seqs,
            max_model_len=max_len, eos_token_ids=tuple(self.eos_token_ids),
            headroom_bytes=headroom_bytes(self._graph_memory_estimate(config, sched_cfg)), size=size,
            lora_slots=0 if config.lora is None else config.lora.max_loras,
            lora_rank=0 if config.lora is None else config.lora.slot_rank)
        log.info("tensor parallel: %d ranks on %s", size, self.device.type)
        return TPDriver.launch(spec, self.device)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any, and close the step trace (idempotent; also runs at
        interpreter exit)."""
        self.structured.close()
        self.step_stats.close()
        if self.tp is not None:
            self.tp.close()

    def _load_tokenizer(self) -> Tokenizer | None:
        if not (self.model_dir / "tokenizer.json").is_file():
            log.warning("no tokenizer.json in %s: token ids only, no stop strings", self.model_dir)
            return None
        return Tokenizer.from_pretrained(self.model_dir)

    # ------------------------------------------------------------------ requests
    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0, arrival_time: float | None = None,
                     lora: str | LoRARequest | None = None) -> Request:
        """Validates and builds a `Request` (raises `EngineRequestError`, or a `LoRAError` for
        `lora`: an adapter name or handle, read from disk here if its host copy is not there:
        pods load it off the engine thread first); does not queue it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineRequestError("this model has no tokenizer: send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise EngineRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise EngineRequestError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise EngineRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum context length of {self.max_model_len} tokens")
        if params.structured is not None and not self.structured.available:
            raise EngineRequestError("structured outputs need the model's tokenizer (tokenizer.json)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.get_request(rid) is not None:
            raise EngineRequestError(f"request id {rid!r} is already in use")
        if lora is not None:
            if self.lora is None:
                raise EngineRequestError("LoRA adapters are not enabled on this engine (--enable-lora)")
            lora = self.lora.request(lora)
        return Request(rid, prompt_ids, params, time.monotonic() if arrival_time is None else arrival_time,
                       priority, lora=lora)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, remote_kv: bool = False,
                    lora: str | LoRARequest | None = None) -> Request:
        """Queues a request. `remote_kv` (decode role): its KV comes from a prefill pod. `lora`:
        its adapter (see `make_request`)."""
        req = self.make_request(prompt, params or SamplingParams(), request_id, priority, lora=lora)
        # Two tokenizer decodes per token: only where the text is read (offline, or to find a stop).
        if self.tokenizer is not None and (self.config.detokenize or req.sampling_params.stop):
            self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                                  req.sampling_params)
        self.structured.add(req)   # its compile starts now, beside its prefill
        try:
            if remote_kv:
                self.scheduler.add_remote_request(req)
            else:
                self.prompt_logprobs.add(req)     # scored where the prompt runs
                self.scheduler.add_request(req)
        except BaseException:
            self.structured.forget([req.request_id])
            self.prompt_logprobs.discard(req.request_id)
            raise
        return req

    def abort(self, request_id: str) -> bool:
        """Idempotent at every stage; frees the request's blocks (held prefill KV included)."""
        self._detok.pop(request_id, None)
        self.structured.forget([request_id])
        self.prompt_logprobs.discard(request_id)
        aborted = self.scheduler.abort_request(request_id)
        in_flight = self._in_flight
        if aborted and in_flight is not None and all(
                r.status is RequestStatus.FINISHED_ABORTED for r in in_flight.requests):
            self._in_flight = None      # nothing left in it to report
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a launched step whose tokens are not out yet (async scheduling)."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def drop_in_flight(self) -> list[str]:
        """Forget a launched step's results (after a failed step); returns its request ids, whose
        callers must be told (some may have finished on their length and wait for their last token)."""
        in_flight, self._in_flight = self._in_flight, None
        return [] if in_flight is None else [r.request_id for r in in_flight.requests]

    # ------------------------------------------------------------------ the step
    @inference_mode      # once per step: the runner and the sampler inside take it as given
    def step(self) -> Sequence[RequestOutput]:
        """One engine step; returns the outputs that became known in it (a `StepOutputs`: token
        rows as columns, `engine.step_outputs`; a list where it has no rows or speculates).

        Synchronous: schedule, run, sample, update, emit. With async scheduling the step planned
        here runs on the device while the previous step's tokens are read back and processed:
        schedule(N) (its decodes take step N-1's tokens as placeholders, filled on the device) ->
        launch model and sampler for N -> resolve N-1 (the one device->host read: its ids; stop
        checks; detokenize; emit) -> update(N) with placeholders. A request whose stop shows up
        in resolve(N-1) was already in batch N: that row's work is dropped (`update` skips it).
        Batches that need the previous token's value on the host (penalties) resolve first, and so
        does a speculative step (`_step_speculative`)."""
        if self.spec is not None and self.spec.wants_step(self.scheduler):
            return self._step_speculative()
        if not self.async_scheduling:
            return self._step_sync()
        t0 = time.perf_counter()
        out = self._schedule()
        prev, self._in_flight = self._in_flight, None
        outputs: Sequence[RequestOutput] = []
        if out.scheduled:
            scheduled = self.scheduler.scheduled_requests
            extra = self.prompt_logprobs.plan(out.scheduled) if self.prompt_logprobs.pending else None
            logits = self.runner.run(out.scheduled, None if prev is None else prev.device, extra)
            requests, sampled_ids = sampled_requests(out.scheduled, scheduled)
            if prev is not None and self.scheduler.reads_host_tokens(requests):
                outputs, prev = self._resolve(prev), None
            sample = self._sample(logits, requests) if requests else None
            if extra is not None:   # read back now (a sync, in this step only): emitted from _resolve
                self.prompt_logprobs.finish(extra)
            if prev is not None:
                outputs = self._resolve(prev)
            updated = self.scheduler.update(out, None)
            if sample is not None:
                self._in_flight = _InFlight(updated, sample, PrevSample(sample.token_ids, ids=sampled_ids))
            self._record_step(out, time.perf_counter() - t0)
        elif prev is not None:
            outputs = self._resolve(prev)
        return outputs

    def _resolve(self, in_flight: _InFlight) -> StepOutputs:
        """Read a launched step's sampled ids back, write them into its requests, emit."""
        result = in_flight.sample.resolve()
        requests = in_flight.requests
        if len(requests) == len(result.token_ids):   # nobody left the batch: rows in order
            tokens, logprobs = result.token_ids, result.logprobs
        else:
            rows = in_flight.device.rows
            row_of = [rows[r.request_id] for r in requests]
            tokens, logprobs = [result.token_ids[i] for i in row_of], [result.logprobs[i] for i in row_of]
        resolved = self._settle_grammars(self.scheduler.resolve_placeholders(requests, tokens))
        if len(resolved) != len(requests):           # aborted meanwhile, or failed its grammar: not emitted
            kept = {id(r) for r in resolved}
            logprobs = [lp for r, lp in zip(requests, logprobs) if id(r) in kept]
            tokens = None
        return self._emit_step(resolved, logprobs, tokens)

    def _sample(self, logits, requests: list[Request]) -> DeviceSample:
        """One step's tokens, on the device, under the requests' grammars (their masks are filled
        here, while the forward pass runs); a request whose grammar failed ends first."""
        return self.sampler.sample_on_device(logits, requests, self._grammar_masks(requests))

    def _grammar_masks(self, rows: list) -> GrammarMask | None:
        """The masks of a step's sampler rows (`rows[i]` samples row i; also a speculative step's,
        `engine.spec_decode`); a request whose grammar failed ends first."""
        mask, failed = self.structured.prepare(rows)
        if failed:
            self._fail(failed)
        return mask

    def _settle_grammars(self, requests: list[Request]) -> list[Request]:
        """Each request's new token into its grammar: a complete grammar stops its request (the
        grammar wins over min_tokens and ignore_eos), a rejected token fails it (dropped here)."""
        if not self.structured.states:
            return requests
        done, failed = self.structured.advance(requests)
        for req in done:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_GRAMMAR)
        if failed:
            self._fail(failed)
            gone = {req.request_id for req, _ in failed}
            requests = [req for req in requests if req.request_id not in gone]
        return requests

    def _fail(self, failed: list[tuple[Request, Exception]]) -> None:
        for req, error in failed:
            self.abort(req.request_id)
            self.failed[req.request_id] = error

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests the engine ended with an error since the last call (a grammar that does not
        compile or fails): their callers must be told, no output will come."""
        failed, self.failed = self.failed, {}
        return list(failed.items())

    def _schedule(self, drafts: dict[str, list[int]] | None = None):
        """`drafts`: a speculative step's (`engine.spec_decode`)."""
        out = self.last_schedule = self.scheduler.schedule(drafts)
        if self.lora is not None:
            self.lora.activate_loads()   # adapters given a slot by this schedule, before its forward
        return out

    def _step_sync(self, t0: float | None = None, speculative: bool = False) -> StepOutputs:
        """`t0`, `speculative`: a speculative step that ran plain (`_step_speculative`)."""
        t0 = time.perf_counter() if t0 is None else t0
        out = self._schedule()
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        if out.scheduled:
            extra = self.prompt_logprobs.plan(out.scheduled) if self.prompt_logprobs.pending else None
            logits = self.runner.run(out.scheduled, extra=extra)
            to_sample = [i for i, s in enumerate(out.scheduled) if s.sample]
            if to_sample:
                scheduled = self.scheduler.scheduled_requests
                result = self._sample(logits, [scheduled[i] for i in to_sample]).resolve()
                for i, token, lp in zip(to_sample, result.token_ids, result.logprobs):
                    sampled[out.scheduled[i].request_id] = token
                    logprobs[out.scheduled[i].request_id] = lp
            # The draft's KV of the same chunks (a prefill engine with a draft model), after the first
            # tokens are read: on a GPU its forward runs while they go out; the pull reads it after the step.
            if self.draft_prefill is not None:
                self.draft_prefill.run(out.scheduled)
            if extra is not None:   # after the sample: the grammar masks were filled beside the forward
                self.prompt_logprobs.finish(extra)
        updated = self._settle_grammars(self.scheduler.update(out, sampled))
        outputs = self._emit_step(updated, list(map(logprobs.get, map(_REQUEST_ID, updated))))
        if out.scheduled:
            self._record_step(out, time.perf_counter() - t0, len(updated) if speculative else None)
        return outputs

    def _step_speculative(self) -> list[RequestOutput]:
        """A step whose decodes carry drafts, verified in one target forward (`engine.spec_decode`).
        Synchronous: the drafts continue each request's newest token, which must be on the host,
        so a step still in flight (async scheduling) is resolved first."""
        t0 = time.perf_counter()
        prev, self._in_flight = self._in_flight, None
        outputs = list(self._resolve(prev)) if prev is not None else []
        spec, scheduler = self.spec, self.scheduler
        drafts = spec.propose(scheduler)
        # Nothing to verify (no n-gram match): a plain step costs less. While a prompt is being
        # scored (prompt logprobs) steps are plain too: only they carry its extra logits rows.
        # Timed from t0 as a speculative step: proposing that found nothing is speculation's cost.
        # Drafts the controller priced as a loss (None, `SpecController.declines`): a plain step, timed as one.
        if not drafts or self.prompt_logprobs.pending:
            return [*outputs, *self._step_sync(t0, speculative=drafts is not None)]
        out = self._schedule(drafts)
        if not out.scheduled:
            return outputs
        requests = scheduler.scheduled_requests
        seqs = spec.fill(out.scheduled, requests)
        verified = spec.verify(self.sampler, self.runner.run(seqs), seqs, requests, self._grammar_masks)
        before = {r.request_id: len(r.output_token_ids) for r in requests}
        updated = self._settle_grammars(scheduler.update(out, verified.tokens))
        spec.settle(requests)
        num_emitted = 0
        for req in updated:
            num = len(req.output_token_ids) - before[req.request_id]
            num_emitted += num
            outputs.append(self._emit(req, req.output_token_ids[-num:], verified.logprobs[req.request_id][:num]))
        self._record_step(out, time.perf_counter() - t0, num_emitted)
        return outputs

    # ------------------------------------------------------------------ decode role edges
    def land_remote_kv(self, request_id: str, first_token_id: int, first_logprobs: TokenLogprobs | None = None,
                       grammar_fingerprint: str = "", prompt_logprobs: PromptLogprobs | None = None
                       ) -> RequestOutput | None:
        """The prompt's KV was written into the reserved blocks: the request joins the batch with
        its first token (sampled by the prefill pod, which also scored the prompt when asked).
        None if it was aborted meanwhile.

        A structured request continues only from a token sampled under the same grammar
        (`grammar_fingerprint`) that its own grammar accepts; otherwise this raises
        `FirstTokenRejected` with nothing changed (prefill locally), or `GrammarCompileError`."""
        req = self.scheduler.get_request(request_id)
        if req is None:
            return None
        if req.sampling_params.structured is not None:
            self.structured.accept_first_token(req, first_token_id, grammar_fingerprint)
        if prompt_logprobs is not None:
            self.prompt_logprobs.received(request_id, prompt_logprobs)
        self.scheduler.remote_kv_landed(request_id, first_token_id)
        self._settle_grammars([req])
        return self._emit(req, [first_token_id], [first_logprobs])

    def fall_back_to_local_prefill(self, request_id: str) -> bool:
        """The pull failed: prefill the prompt here (same tokens: seeded sampling is positional)."""
        self.structured.reset(request_id)
        falls_back = self.scheduler.remote_kv_failed(request_id)
        if falls_back:
            self.prompt_logprobs.add(self.scheduler.get_request(request_id))
        return falls_back

    def _emit_step(self, requests: list[Request], logprobs: list, tokens: list[int] | None = None) -> StepOutputs:
        """A step's outputs for `requests`, each with its newest token (`tokens[i]`, when the
        caller has them; `logprobs[i]`: its logprobs or None): token rows as columns, an `_emit`
        for every other row (`engine.step_outputs`)."""
        if tokens is None:
            tokens = list(map(_LAST, map(_OUTPUTS, requests)))
        rows = other_rows(requests, logprobs, self._detok, self.prompt_logprobs.has_done)
        if rows is None:
            return StepOutputs(requests, tokens)
        emit = self._emit
        return StepOutputs(requests, tokens, {i: emit(requests[i], [tokens[i]], [logprobs[i]]) for i in rows})

    def _emit(self, req: Request, new_ids: list[int], new_logprobs: list) -> RequestOutput:
        """The step's output for one request; runs its detokenizer, if it has one (stop strings)."""
        text_delta = ""
        if req.is_finished and self.structured.states:
            self.structured.forget([req.request_id])
        detok = self._detok.get(req.request_id) if self._detok else None
        status = req.status
        if detok is not None:
            # A stop token's own text is dropped (vLLM), even with skip_special_tokens=False.
            delta = detok.update(new_ids, stop_terminated=req.status is RequestStatus.FINISHED_STOPPED)
            text_delta = delta.text
            if delta.stopped and len(new_ids) > 1:   # verified drafts: the stop string may end it early
                new_ids, new_logprobs = self._cut_after_stop_string(req, detok, new_ids, new_logprobs)
            if delta.stopped and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = delta.stop_reason
            elif req.is_finished and not delta.stopped:
                text_delta += detok.flush().text
            if req.is_finished:
                del self._detok[req.request_id]
            status = req.status
        # Positional (one per request per step: keywords cost twice as much; the field order is
        # pinned by tests/engine/test_engine_outputs.py).
        out = RequestOutput(req.request_id, new_ids, new_logprobs, text_delta, status.is_finished,
                            status.finish_reason, len(req.prompt_token_ids), req.num_cached_tokens,
                            req.output_token_ids, detok.output_text if detok else "", req.first_token_time,
                            req.arrival_time, req.first_scheduled_time, req.stop_reason)
        if self.prompt_logprobs.has_done:   # on the request's first output
            out.prompt_logprobs = self.prompt_logprobs.take(req.request_id)
        return out

    def _cut_after_stop_string(self, req: Request, detok: IncrementalDetokenizer, new_ids: list[int],
                               new_logprobs: list) -> tuple[list[int], list]:
        """Several tokens in one step (speculative decoding) and a stop string in them: the tokens
        after the one that completed it are dropped, and the request ends on the string, as it
        would have one token per step."""
        keep = detok.num_output_tokens - (len(req.output_token_ids) - len(new_ids))
        if keep >= len(new_ids):
            return new_ids, new_logprobs
        drop = len(new_ids) - keep
        del req.output_token_ids[-drop:], req.token_ids[-drop:]
        if req.is_finished:          # on its length or a stop token, both among the dropped tokens
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = detok.stop_reason
        return new_ids[:keep], new_logprobs[:keep]

    def _record_step(self, out, seconds: float, num_emitted: int | None = None) -> None:
        """`num_emitted`: the tokens a speculative step emitted (None: a plain step)."""
        self.step_stats.record(out, seconds)
        if self.spec is not None:
            self.spec.observe_step(out, seconds, len(out.scheduled) if num_emitted is None else num_emitted,
                                   speculative=num_emitted is not None)

    @property
    def step_samples(self) -> collections.deque[StepSample]:
        """The latest steps' samples (the router's step-time model reads them in load reports)."""
        return self.step_stats.samples

    @property
    def num_steps(self) -> int:
        return self.step_stats.num_steps

    def reset_step_stats(self) -> None:
        """Forget step timings (after a warm-up whose first step includes one-off costs)."""
        self.step_stats.reset()

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress_desc: str | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion (continuous batching) and returns one output each, in order
        (with its prompt logprobs when asked).

        `progress_desc` labels a bar of finished requests, drawn only on a terminal (benchmarks).
        `lora`: one adapter name for every prompt, or one per prompt (None: the base model)."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        reqs = [self.add_request(p, sp, lora=a) for p, sp, a in zip(prompts, params, loras)]
        final: dict[str, RequestOutput] = {}
        scores: dict[str, PromptLogprobs] = {}   # from each first output, kept on the final one
        bar = progress(desc=progress_desc or "", total=len(reqs), unit="req", leave=True,
                       quiet=progress_desc is None)
        while self.has_unfinished_requests():
            for o in split(self.step())[2]:      # token rows neither finish nor carry scores
                if o.prompt_logprobs is not None:
                    scores[o.request_id] = o.prompt_logprobs
                if o.finished:
                    o.prompt_logprobs = scores.get(o.request_id)
                    final[o.request_id] = o
                    bar.update(1)
        bar.close()
        failures = dict(self.take_failures())
        for r in reqs:
            if r.request_id in failures:
                raise failures[r.request_id]
        return [final[r.request_id] for r in reqs]

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        return self.step_stats.snapshot(
            self.scheduler, lora_adapters=() if self.lora is None else self.lora.stats(self.scheduler),
            spec_decode=None if self.spec is None else self.spec.stats.copy(),
            max_loras=0 if self.lora is None else self.lora.config.max_loras)
