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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from engine.config import QUANTIZATIONS, CacheConfig, SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import allocate_kv_cache, num_blocks_for_memory
from engine.loader import load_model, model_fingerprint
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, RequestOutput, StepSample
from engine.presets import resolve_model_dir
from engine.quant import quantize_model
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ROLES, Scheduler
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineRequestError(ValueError):
    """A request the engine cannot take (bad prompt, too long, unknown tokens); nothing is queued."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    role: str = "colocated"
    device: str = "cpu"
    dtype: str | None = None            # None: float32 on CPU, the checkpoint's dtype on CUDA
    max_model_len: int | None = None    # None: the model's
    quantization: str | None = None     # "int8": W8A8 linears on CPU (engine/quant.py); None: none
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.role = config.role
        self.model_dir: Path = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.device = torch.device(config.device)
        dtype_name = config.dtype or ("float32" if self.device.type == "cpu" else self.model_config.torch_dtype)
        self.dtype = DTYPES[dtype_name]
        max_len = min(config.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=max_len)
        cache_cfg = config.cache
        if cache_cfg.num_blocks is None:
            cache_cfg = dataclasses.replace(cache_cfg, num_blocks=num_blocks_for_memory(
                self.model_config, cache_cfg.block_size, self.dtype, cache_cfg.kv_cache_memory_bytes))
        self.scheduler_config, self.cache_config = sched_cfg, cache_cfg

        self.tokenizer = self._load_tokenizer()
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.model_config.eos_token_ids
        self.eos_token_ids = eos or self.model_config.eos_token_ids
        self.model = load_model(self.model_dir, self.model_config, self.dtype, self.device, max_len + 1)
        self.fingerprint = model_fingerprint(self.model_dir)
        if config.quantization:
            quantize_model(self.model, config.quantization, self.device)
            # A quantized model computes other K/V than the plain one: pods must not pair across.
            self.fingerprint += f"+{config.quantization}"
        self.kv_cache = allocate_kv_cache(self.model_config, cache_cfg.num_blocks, cache_cfg.block_size,
                                          self.dtype, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, cache_cfg.block_size, self.device)
        self.sampler = Sampler(self.eos_token_ids)
        self.scheduler = Scheduler(sched_cfg, cache_cfg, role=self.role, eos_token_ids=self.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._step_ewma = 0.0
        self._prefill_rate = 0.0
        self.num_steps = 0
        self.last_schedule = None  # the last step's SchedulerOutput (pods read reserved ids from it)
        self.step_samples: collections.deque[StepSample] = collections.deque(maxlen=256)
        log.info("engine ready: role=%s model=%s dtype=%s quantization=%s blocks=%d x %d", self.role,
                 config.model, dtype_name, config.quantization or "none", cache_cfg.num_blocks,
                 cache_cfg.block_size)

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
                     priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validates and builds a `Request` (raises `EngineRequestError`); does not queue it."""
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
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.get_request(rid) is not None:
            raise EngineRequestError(f"request id {rid!r} is already in use")
        return Request(rid, prompt_ids, params, time.monotonic() if arrival_time is None else arrival_time,
                       priority)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, remote_kv: bool = False) -> Request:
        """Queues a request. `remote_kv` (decode role): its KV comes from a prefill pod."""
        req = self.make_request(prompt, params or SamplingParams(), request_id, priority)
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                                  req.sampling_params)
        if remote_kv:
            self.scheduler.add_remote_request(req)
        else:
            self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Idempotent at every stage; frees the request's blocks (held prefill KV included)."""
        self._detok.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.last_schedule = self.scheduler.schedule()
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        if out.scheduled:
            logits = self.runner.run(out.scheduled)
            to_sample = [s for s in out.scheduled if s.sample]
            if to_sample:
                requests = [self.scheduler.get_request(s.request_id) for s in to_sample]
                result = self.sampler.sample(logits, requests)
                for seq, token, lp in zip(to_sample, result.token_ids, result.logprobs):
                    sampled[seq.request_id] = token
                    logprobs[seq.request_id] = lp
        updated = self.scheduler.update(out, sampled)
        outputs = [self._emit(req, [req.output_token_ids[-1]], [logprobs.get(req.request_id)])
                   for req in updated]
        if out.scheduled:
            self._record_step(out, time.perf_counter() - t0)
        return outputs

    # ------------------------------------------------------------------ decode role edges
    def land_remote_kv(self, request_id: str, first_token_id: int,
                       first_logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """The prompt's KV was written into the reserved blocks: the request joins the batch with
        its first token (sampled by the prefill pod). None if it was aborted meanwhile."""
        req = self.scheduler.get_request(request_id)
        if req is None:
            return None
        self.scheduler.remote_kv_landed(request_id, first_token_id)
        return self._emit(req, [first_token_id], [first_logprobs])

    def fall_back_to_local_prefill(self, request_id: str) -> bool:
        """The pull failed: prefill the prompt here (same tokens: seeded sampling is positional)."""
        return self.scheduler.remote_kv_failed(request_id)

    def _emit(self, req: Request, new_ids: list[int], new_logprobs: list) -> RequestOutput:
        text_delta = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            # A stop token's own text is dropped (vLLM), even with skip_special_tokens=False.
            delta = detok.update(new_ids, stop_terminated=req.status is RequestStatus.FINISHED_STOPPED)
            text_delta = delta.text
            if delta.stopped and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = delta.stop_reason
            elif req.is_finished and not delta.stopped:
                text_delta += detok.flush().text
        if req.is_finished:
            self._detok.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, new_logprobs=new_logprobs,
            text_delta=text_delta, finished=req.is_finished, finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            output_token_ids=req.output_token_ids, text=detok.output_text if detok else "",
            first_token_time=req.first_token_time, arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time, stop_reason=req.stop_reason)

    def _record_step(self, out, seconds: float) -> None:
        num_prefill = sum(len(s.token_ids) for s in out.scheduled if len(s.token_ids) > 1)
        context = sum(s.start_position + len(s.token_ids) for s in out.scheduled)
        self.step_samples.append(StepSample(len(out.scheduled), context, num_prefill, seconds))
        alpha = 0.1
        self._step_ewma = seconds if self.num_steps == 0 else (1 - alpha) * self._step_ewma + alpha * seconds
        if num_prefill:
            rate = out.num_batched_tokens / seconds
            self._prefill_rate = rate if self._prefill_rate == 0 else (1 - alpha) * self._prefill_rate + alpha * rate
        self.num_steps += 1

    def reset_step_stats(self) -> None:
        """Forget step timings (after a warm-up whose first step includes one-off costs)."""
        self._step_ewma = self._prefill_rate = 0.0
        self.num_steps = 0
        self.step_samples.clear()

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion (continuous batching) and returns one output each, in order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r.request_id] for r in reqs]

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        s = self.scheduler
        pool = s.kv_manager.block_pool
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, prefill_queue_tokens=s.prefill_queue_tokens,
            num_free_blocks=pool.num_free_blocks, num_total_blocks=pool.num_usable_blocks,
            kv_cache_usage=pool.usage, prefix_cache_hit_ratio=s.kv_manager.hit_ratio,
            num_preemptions=s.num_preemptions, step_seconds_ewma=self._step_ewma,
            prefill_tokens_per_second=self._prefill_rate, num_steps=self.num_steps)
