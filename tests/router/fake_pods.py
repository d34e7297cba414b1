"""Test doubles for pods: small real `grpc.aio` servers speaking PrefillService / DecodeService.

They run no model. Tokens come from a deterministic function of (prompt, output index), the same on
a prefill and a decode pod, so disaggregated and colocated runs agree and tests can predict the
text. Each pod has a `Script` (delays, failures, EOS position, the load it reports) that tests can
change while it runs, and records what it received: requests, cancellations, aborts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from kvtransfer.grpc_options import server_options
from wire import cbserve_pb2 as pb
from wire import cbserve_pb2_grpc as pb_grpc

EOS_ID = 2                      # `</s>` in engine.tokenizer.build_byte_level_tokenizer
BYTE_OFFSET = 4                 # byte b has id 4 + b there
ALPHABET = "abcdefgh "


def token_for(prompt_token_ids, index: int) -> int:
    """The fake model: a letter or space chosen from the prompt and the output position."""
    return BYTE_OFFSET + ord(ALPHABET[(sum(prompt_token_ids) + 3 * index) % len(ALPHABET)])


def fake_prompt_logprobs(prompt_token_ids, num_top: int, vocab_size: int = 260) -> pb.PromptLogprobs:
    """The fake model's prompt scores: token i+1 gets -(id % 7 + 1) / 4, rank id % 3 + 1, and the
    alternatives id, id+1, ... (mod vocab) with logprobs -0.1, -0.2, ..."""
    targets = list(prompt_token_ids[1:])
    return pb.PromptLogprobs(
        token_logprobs=[-(t % 7 + 1) / 4 for t in targets], token_ranks=[t % 3 + 1 for t in targets],
        num_top=num_top, top_token_ids=[(t + j) % vocab_size for t in targets for j in range(num_top)],
        top_logprobs=[-0.1 * (j + 1) for _ in targets for j in range(num_top)])


def expected_tokens(prompt_token_ids, max_tokens: int, eos_at: int | None = None) -> list[int]:
    out = []
    for i in range(max_tokens):
        if eos_at is not None and i == eos_at:
            out.append(EOS_ID)
            break
        out.append(token_for(prompt_token_ids, i))
    return out


@dataclass
class Script:
    """How a fake pod behaves; tests mutate it while the pod runs."""

    first_token_delay: float = 0.0          # prefill time (P) or local-prefill time (colocated/D)
    token_delay: float = 0.0                # between decode messages
    tokens_per_message: int = 1             # tokens per GenerateResponse (a real pod sends one per step)
    fail_generate: grpc.StatusCode | None = None
    fail_generate_after: int | None = None  # Generate breaks (UNAVAILABLE) after this many tokens
    abort_generate: bool = False            # Generate ends at once with finish_reason "abort"
    lost_source: str | None = None          # Generate fails (UNAVAILABLE) when pulling from this address
    fail_prefill: grpc.StatusCode | None = None
    down: bool = False                      # every RPC fails UNAVAILABLE (a crashed pod)
    watch_broken: bool = False              # WatchLoad raises (UNKNOWN); GetLoad still works
    eos_at: int | None = None               # output index that is EOS
    output_token_ids: list[int] | None = None   # the model's output instead of the fake function (ends in EOS)
    grammar_fingerprint: str = ""           # prefill: what a constrained first token was sampled under
    logprob: float = -0.5
    top_alternatives: tuple[int, ...] | None = None   # logprobs' alternatives (default: the token itself)
    max_model_len: int = 256
    vocab_size: int = 260
    block_size: int = 16
    load: pb.LoadReport = field(default_factory=pb.LoadReport)   # LoRA adapters: load.lora_adapters
    # LoadLoRAAdapter of this adapter name fails with (code, details); and as a whole.
    lora_refusals: dict[str, tuple[grpc.StatusCode, str]] = field(default_factory=dict)


class _Records:
    def __init__(self) -> None:
        self.prefill_requests: list[pb.PrefillRequest] = []
        self.generate_requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.cancel_seen = asyncio.Event()
        self.lora_calls: list[tuple[str, str]] = []     # ("load" | "unload", adapter name)

    @property
    def num_requests(self) -> int:
        return len(self.prefill_requests) + len(self.generate_requests)


_BY_ADDRESS: dict[str, "FakePod"] = {}     # running fakes, so a fake D can wait for its P


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _RequestContext:
    """What a fake `Generate` handler uses of a call's context, for a request on a Session."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class SessionOverGenerate:
    """A fake pod's `Session`: its `Generate` handler per request; what the handlers produced
    since the last message goes out in one (as a real pod packs an engine step), a heartbeat in
    every idle second."""

    async def Session(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def run_one(request: pb.GenerateRequest) -> None:
            try:
                async for response in self.Generate(request, _RequestContext()):
                    response.request_id = request.request_id
                    out.put_nowait(pb.SessionResponse(outputs=[response]))
            except _Aborted as e:
                out.put_nowait(pb.SessionResponse(errors=[pb.RequestError(
                    request_id=request.request_id, code=e.code.value[0], message=e.details)]))
            finally:
                tasks.pop(request.request_id, None)

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "generate":
                    tasks[message.generate.request_id] = asyncio.create_task(run_one(message.generate))
                elif (task := tasks.pop(message.cancel_request_id, None)) is not None:
                    task.cancel()

        reader = asyncio.create_task(read())
        try:
            yield pb.SessionResponse(heartbeat_seconds=1.0)
            while True:
                try:
                    message = await asyncio.wait_for(out.get(), 1.0)
                except asyncio.TimeoutError:
                    message = pb.SessionResponse()
                while not out.empty():
                    message.MergeFrom(out.get_nowait())
                yield message
        finally:
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()


class FakePod(SessionOverGenerate, pb_grpc.PrefillServiceServicer, pb_grpc.DecodeServiceServicer):
    """One fake pod; `role` is "prefill", "decode" or "colocated"."""

    def __init__(self, role: str, script: Script | None = None, pod_id: str = "") -> None:
        self.role = role
        self.script = script or Script()
        self.records = _Records()
        self.pod_id = pod_id or f"fake-{role}"
        self.address = ""
        self._server: grpc.aio.Server | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, port: int = 0, interceptors=()) -> FakePod:
        self._server = grpc.aio.server(interceptors=list(interceptors), options=server_options())
        if self.role == "prefill":
            pb_grpc.add_PrefillServiceServicer_to_server(self, self._server)
        else:
            pb_grpc.add_DecodeServiceServicer_to_server(self, self._server)
        bound = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{bound}"
        _BY_ADDRESS[self.address] = self
        await self._server.start()
        return self

    async def stop(self) -> None:
        _BY_ADDRESS.pop(self.address, None)
        if self._server is not None:
            await self._server.stop(grace=None)

    async def _check_up(self, context) -> None:
        if self.script.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pod is down")

    # -- shared RPCs ----------------------------------------------------------------------------------
    async def Handshake(self, request, context):
        await self._check_up(context)
        s = self.script
        return pb.HandshakeResponse(pod_id=self.pod_id, kv_transports=["grpc"], model=pb.ModelInfo(
            model_name="fake", max_model_len=s.max_model_len, vocab_size=s.vocab_size, block_size=s.block_size))

    def _report(self) -> pb.LoadReport:
        report = pb.LoadReport()
        report.CopyFrom(self.script.load)
        report.pod_id, report.role = self.pod_id, self.role
        return report

    async def GetLoad(self, request, context):
        await self._check_up(context)
        return self._report()

    async def WatchLoad(self, request, context):
        interval = request.interval_seconds or 0.05
        if self.script.watch_broken:
            raise RuntimeError("scripted WatchLoad bug")
        while True:
            await self._check_up(context)
            yield self._report()
            await asyncio.sleep(interval)

    async def Abort(self, request, context):
        self.records.aborted.append(request.request_id)
        return pb.AbortResponse(found=True)

    # -- LoRA adapters (the registry is the reported list) ---------------------------------------------
    async def LoadLoRAAdapter(self, request, context):
        await self._check_up(context)
        self.records.lora_calls.append(("load", request.lora_name))
        refusal = self.script.lora_refusals.get(request.lora_name)
        if refusal is not None:
            await context.abort(*refusal)
        adapters = self.script.load.lora_adapters
        if any(a.name == request.lora_name for a in adapters):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter {request.lora_name!r} is already loaded")
        adapters.add(name=request.lora_name, identity=f"id-{request.lora_path}", registered=True)
        return pb.LoRAAdapterResponse(identity=f"id-{request.lora_path}")

    async def UnloadLoRAAdapter(self, request, context):
        await self._check_up(context)
        self.records.lora_calls.append(("unload", request.lora_name))
        adapters = self.script.load.lora_adapters
        kept = [a for a in adapters if a.name != request.lora_name]
        if len(kept) == len(adapters):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not loaded")
        del adapters[:]
        adapters.extend(kept)
        return pb.LoRAAdapterResponse()

    # -- prefill ----------------------------------------------------------------------------------------
    async def Prefill(self, request, context):
        self.records.prefill_requests.append(request)
        try:
            await self._check_up(context)
            await asyncio.sleep(self.script.first_token_delay)
            if self.script.fail_prefill is not None:
                await context.abort(self.script.fail_prefill, "scripted prefill failure")
            token = self._tokens(request, 1, self.script.eos_at)[0]
            finished = request.sampling.max_tokens == 1 or token == EOS_ID
            reason = ("stop" if token == EOS_ID else "length") if finished else ""
            response = pb.PrefillResponse(
                request_id=request.request_id, first_token_id=token, finished=finished, finish_reason=reason,
                first_token_logprobs=self._logprobs(token, request.sampling),
                grammar_fingerprint=self.script.grammar_fingerprint if request.sampling.HasField("structured") else "",
                queue_seconds=0.001, prefill_seconds=self.script.first_token_delay)
            self._score_prompt(request, response)
            return response
        except asyncio.CancelledError:
            self.records.cancelled.append(request.request_id)
            self.records.cancel_seen.set()
            raise

    def _tokens(self, request, max_tokens: int, eos_at: int | None) -> list[int]:
        """The output of `request`: the scripted ids (then EOS), else the fake model's."""
        if self.script.output_token_ids is not None:
            return [*self.script.output_token_ids, EOS_ID][:max_tokens]
        return expected_tokens(request.prompt_token_ids, max_tokens, eos_at)

    def _logprobs(self, token: int, sampling: pb.SamplingParams) -> pb.TokenLogprobs:
        top = []
        if sampling.HasField("logprobs"):
            alternatives = self.script.top_alternatives or (token,)
            top = [pb.TopLogprob(token_id=t, logprob=self.script.logprob - 0.1 * j)
                   for j, t in enumerate(alternatives)][: sampling.logprobs]
        return pb.TokenLogprobs(logprob=self.script.logprob, top=top)

    def _score_prompt(self, request, response) -> None:
        if request.sampling.HasField("prompt_logprobs"):
            response.prompt_logprobs.CopyFrom(fake_prompt_logprobs(
                request.prompt_token_ids, request.sampling.prompt_logprobs, self.script.vocab_size))

    # -- decode -----------------------------------------------------------------------------------------
    async def _until_prefill_arrived(self, request) -> None:
        """As a real D's pull waits (bounded) for its Prefill to reach P."""
        source = _BY_ADDRESS.get(request.prefill_from)
        if source is not None and not source.script.down:
            await _wait_for(lambda: any(r.request_id == request.request_id
                                        for r in source.records.prefill_requests))

    async def Generate(self, request, context):
        self.records.generate_requests.append(request)
        s = self.script
        try:
            await self._check_up(context)
            if s.fail_generate is not None:
                await context.abort(s.fail_generate, "scripted generate failure")
            if s.lost_source is not None and request.prefill_from == s.lost_source:
                await asyncio.sleep(0.1)          # the source's failure reaches the router first
                await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill source lost, no local fallback")
            if s.abort_generate:
                yield pb.GenerateResponse(request_id=request.request_id, finished=True, finish_reason="abort")
                return
            # A real D waits for the KV pull, which ends with P's first token (so P has the request);
            # local prefill takes as long.
            await self._until_prefill_arrived(request)
            await asyncio.sleep(s.first_token_delay)
            tokens = self._tokens(request, request.sampling.max_tokens,
                                  None if request.sampling.ignore_eos else s.eos_at)
            for i in range(0, len(tokens), s.tokens_per_message):
                if i > 0:
                    await asyncio.sleep(s.token_delay)
                ids = tokens[i:i + s.tokens_per_message]
                if s.fail_generate_after is not None and i <= s.fail_generate_after < i + len(ids):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted mid-stream failure")
                last = i + len(ids) == len(tokens)
                reason = ("stop" if ids[-1] == EOS_ID else "length") if last else ""
                response = pb.GenerateResponse(
                    request_id=request.request_id, index=i, token_ids=ids,
                    logprobs=[self._logprobs(token, request.sampling) for token in ids], finished=last,
                    finish_reason=reason, num_prompt_tokens=len(request.prompt_token_ids))
                if i == 0:
                    self._score_prompt(request, response)
                    response.local_prefill = not request.prefill_from
                    response.kv_transfer_seconds = 0.0 if not request.prefill_from else 0.002
                    response.queue_seconds = 0.001
                yield response
        except asyncio.CancelledError:
            self.records.cancelled.append(request.request_id)
            self.records.cancel_seen.set()
            raise


async def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)


async def start_pods(role: str, scripts: list[Script], interceptors=()) -> list[FakePod]:
    return [await FakePod(role, script, pod_id=f"{role}-{i}").start(interceptors=interceptors)
            for i, script in enumerate(scripts)]
