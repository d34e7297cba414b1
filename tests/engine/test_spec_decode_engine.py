"""Speculative decoding in the engine: output equals the non-speculative engine, token for token.

On a two-layer random Llama with the tiny preset's tokenizer (quick steps), greedy and seeded
sampling with the n-gram proposer, with a draft model (the same checkpoint: a draft equal to
the target is accepted at every greedy position, so every step emits several tokens, which is
what the edge cases need) and with a random-weight EAGLE head (its drafts checked against a
transformers reference, since the target rejects nearly all of them): logprobs, penalties,
min_tokens, stop strings completed in the middle of a verified run, stop tokens, max_tokens,
preemption under a small cache, async scheduling moving in and out of speculative steps, the
decode role landing remote KV (the draft prefills itself from the prompt), prefix-cache hits,
and the adaptive controller as shipped. Most engines force speculation (`FixedController`) so the
verification path runs every step.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.sampling.params import SamplingParams
from engine.scheduling.output import ScheduledSeq
from engine.spec_decode.adaptive import FixedController, SpecController
from engine.presets import resolve_model_dir
from engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from tests.engine.hf_models import make_eagle_head, make_hf_model
from tests.engine.pd_handoff import run_disaggregated

# Aborts in the leak test: 300 keeps it within its share of CI on two cores;
# CBSERVE_SPEC_ABORTS=1000 runs the full count (as tests/faults/test_cancellations.py does).
NUM_ABORTS = int(os.environ.get("CBSERVE_SPEC_ABORTS", "300"))

MICRO = {"micro": ("LlamaConfig", "LlamaForCausalLM", dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=260, max_position_embeddings=512))}
NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
_model: dict[str, str] = {}


def micro_model(root: Path) -> str:
    """A 2-layer random Llama on the tiny preset's tokenizer (stop strings need text), made once."""
    if "path" not in _model:
        make_hf_model("micro", root, seed=3, configs=MICRO)
        tiny = resolve_model_dir("tiny", create_weights=False)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tiny / name, root / name)
        _model["path"] = str(root)
    return _model["path"]


@pytest.fixture(scope="module", autouse=True)
def _micro(tmp_path_factory):
    micro_model(tmp_path_factory.mktemp("spec-micro"))


def draft_config() -> SpeculativeConfig:
    """The draft model is the target's own checkpoint."""
    return SpeculativeConfig("draft_model", 4, model=_model["path"])


def eagle_config() -> SpeculativeConfig:
    """A random-weight EAGLE-1 head on the target, written once."""
    root = Path(_model["path"])
    head = root.parent / f"{root.name}-eagle"
    if not head.exists():
        make_eagle_head(root, head, seed=5)
    return SpeculativeConfig("eagle", 4, model=str(head))


def _config(method: str) -> SpeculativeConfig:
    return NGRAM if method == "ngram" else draft_config() if method == "draft_model" else eagle_config()


def make_engine(spec: SpeculativeConfig | None = None, forced: bool = True, num_blocks: int = 256,
                async_scheduling: bool = False, role: str = "colocated", **sched) -> Engine:
    engine = Engine(EngineConfig(model=_model["path"], role=role, speculative=spec, async_scheduling=async_scheduling,
                                 cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **sched})))
    if spec is not None and forced and engine.spec is not None:
        engine.spec.controller = FixedController(spec.num_speculative_tokens)
    return engine


@pytest.fixture(scope="module")
def plain(_micro) -> Engine:
    return make_engine()


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec(request, _micro) -> Engine:
    return make_engine(_config(request.param))


@pytest.fixture(scope="module")
def draft(_micro) -> Engine:
    return make_engine(draft_config())


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(n - 1)]


def _summary(outputs):
    return [(o.output_token_ids, o.text, o.finish_reason, o.stop_reason) for o in outputs]


def _same(plain: Engine, spec: Engine, prompts, params, verified: bool = True):
    want = plain.generate(prompts, params)
    before = spec.stats().spec_decode.num_drafts
    got = spec.generate(prompts, params)
    assert _summary(got) == _summary(want)
    if verified:
        assert spec.stats().spec_decode.num_drafts > before      # the drafts were verified
    assert spec.stats().kv_cache_usage == 0.0 and not spec.has_unfinished_requests()
    spec.scheduler.check_invariants()
    return want, got


PROMPTS = [_prompt(s, n) for s, n in ((1, 9), (2, 40), (3, 90), (4, 17))]   # 90 > budget: chunked


def test_greedy_output_equals_the_plain_engine(plain, spec):
    _same(plain, spec, PROMPTS, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))


def test_a_draft_equal_to_the_target_is_accepted_at_every_greedy_position(plain, draft):
    before = draft.stats().spec_decode.copy()
    _same(plain, draft, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    after = draft.stats().spec_decode
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert proposed > 20 and accepted >= 0.95 * proposed    # (fp32: a near-tie may flip, rarely)


@pytest.fixture(scope="module")
def ngram(_micro) -> Engine:
    return make_engine(NGRAM)


def test_seeded_sampling_equals_the_plain_engine(plain, ngram):
    """n-gram drafts only: the rows are sampled the same way whoever proposed the drafts (a
    draft model's proposals are covered by the greedy tests, which accept them most)."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=12, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.1, seed=13, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    _same(plain, ngram, PROMPTS, params)


@pytest.fixture(scope="module")
def eagle(_micro) -> Engine:
    return make_engine(eagle_config())


def test_eagle_drafts_equal_a_transformers_reference(eagle):
    """The head's drafts in its first two speculative steps (after the prefill, then after a
    verification), against EAGLE's definition computed with transformers: the target's final
    (normed) hidden states h_p and the embedding of token p + 1 through fc, the head's Llama layer
    (no input norm at layer 0) and the target's lm_head; each further draft feeds the head's own
    output back, one position on."""
    import torch
    import transformers
    from safetensors.torch import load_file

    seen = []
    verify = eagle.spec.verify
    eagle.spec.verify = lambda sampler, logits, seqs, *rest: seen.append(seqs[0]) or verify(sampler, logits, seqs,
                                                                                             *rest)
    try:
        (out,) = eagle.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    finally:
        del eagle.spec.verify
    sequence = [*PROMPTS[1], *out.output_token_ids]

    target = transformers.AutoModelForCausalLM.from_pretrained(_model["path"], dtype=torch.float32).eval()
    head_dir = Path(eagle_config().model)
    head = transformers.LlamaModel(transformers.LlamaConfig.from_pretrained(head_dir)).eval()
    weights = load_file(str(head_dir / "model.safetensors"))
    fc = weights["fc.weight"]
    head.layers.load_state_dict({k.removeprefix("layers."): v for k, v in weights.items() if k != "fc.weight"},
                                strict=False)
    head.layers[0].input_layernorm, head.norm = torch.nn.Identity(), torch.nn.Identity()
    embed = target.model.embed_tokens
    for _, (newest, *drafts), n, *_ in seen[:2]:
        assert sequence[n] == newest and len(drafts) == 4
        with torch.no_grad():
            h = target(torch.tensor([sequence[:n]]), output_hidden_states=True).hidden_states[-1][0]   # [n, H]
            rows = torch.cat((embed(torch.tensor(sequence[1:n + 1])), h), dim=-1) @ fc.t()               # [n, H]
            want = []
            for _ in drafts:
                last = head(inputs_embeds=rows[None]).last_hidden_state[0, -1]
                want.append(int(target.lm_head(last).argmax()))
                rows = torch.cat((rows, (torch.cat((embed(torch.tensor(want[-1])), last)) @ fc.t())[None]))
        assert drafts == want


def test_eagle_greedy_seeded_and_the_decode_role_equal_the_plain_engine(plain, eagle):
    """Greedy rows token for token and seeded rows draw for draw, whatever the head proposed
    (prompt 3 is chunked: the head catches up on hidden states from two prefill steps); a decode
    engine has no hidden states for a prompt prefilled elsewhere (the head reads zeros there) and
    its tokens equal the colocated plain engine's."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=12, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    _same(plain, eagle, PROMPTS[:3], params)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = plain.generate(PROMPTS[:3], greedy)
    decode = make_engine(eagle_config(), role="decode")
    assert run_disaggregated(make_engine(role="prefill"), decode, PROMPTS[:3], greedy) == \
        [w.output_token_ids for w in want]
    assert decode.stats().spec_decode.num_drafts > 0 and decode.stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("change, names", [
    (dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1), "hidden_size is 32"),
    (dict(drop=("fc.weight",)), "missing tensors for: fc.weight"),
    (dict(drop=("layers.0.mlp.down_proj.weight",)), "layers.0.mlp.down_proj.weight"),
])
def test_a_malformed_eagle_head_is_refused_at_startup_naming_the_key(tmp_path, change, names):
    make_eagle_head(Path(_model["path"]), tmp_path / "head", **change)
    with pytest.raises(SpeculativeConfigError, match=names):
        make_engine(SpeculativeConfig("eagle", 2, model=str(tmp_path / "head")))


def test_logprobs_penalties_and_min_tokens_equal_the_plain_engine(plain, spec):
    params = [SamplingParams(temperature=0.0, max_tokens=30, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.4,
                             presence_penalty=0.2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, presence_penalty=0.5, logprobs=1,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, stop_token_ids=[7, 9, 11])]
    want, got = _same(plain, spec, PROMPTS, params)
    for w, g in ((want[0], got[0]), (want[2], got[2])):
        assert len(g.output_token_ids) == len(w.output_token_ids)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_max_tokens_is_exact_with_drafts_in_flight(plain, draft, max_tokens):
    _same(plain, draft, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
          verified=max_tokens > 2)      # 1 token: prefill only; 2: one decode with max_tokens - 2 = 0 drafts


def test_stop_strings_and_stop_tokens_inside_a_verified_run(plain, draft):
    """A draft equal to the target emits 5 tokens a step: stops that complete at output tokens 6-9
    fall inside a run, and the tokens after them must go."""
    prompt = PROMPTS[1]
    (free,) = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    tokens, text = free.output_token_ids, free.text
    checked = 0
    for index in range(6, 10):
        token = tokens[index]
        if token not in tokens[:index]:        # first occurrence: the plain engine stops right there
            _same(plain, draft, [prompt], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[token]))
            checked += 1
    for start in range(4, 12):
        stop = text[start:start + 2]
        if len(stop) == 2 and stop not in text[:start + 1] and "\ufffd" not in stop:
            want, got = _same(plain, draft, [prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))
            assert got[0].finish_reason == "stop" and got[0].stop_reason == stop
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_preemption_under_a_small_cache_equals_the_plain_engine(method):
    prompts = [_prompt(s, 40 + 9 * s) for s in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = make_engine(num_blocks=14).generate(prompts, params)
    spec = make_engine(_config(method), num_blocks=14)
    got = spec.generate(prompts, params)
    assert spec.stats().num_preemptions > 0
    assert _summary(got) == _summary(want)
    pool = spec.scheduler.kv_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    spec.scheduler.check_invariants()


class _EveryOther(SpecController):
    """Speculate on every other step (forcing the async <-> speculative transitions)."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self._n = 0

    def wants_step(self, batch_size: int, mixed: bool = False, predict=None) -> bool:
        self._n += 1
        if predict is not None:      # shadow drafts on the plain steps, placeholders and all
            predict()
        return self._n % 2 == 0

    def shadows(self, batch_size: int) -> bool:
        return True

    def num_drafts(self, request, batch_size: int, limit: int, retry: bool = True) -> int:
        return max(0, min(limit, self.max_drafts))


def test_async_scheduling_in_and_out_of_speculative_steps_equals_the_plain_engine(plain):
    spec = make_engine(NGRAM, async_scheduling=True)
    spec.spec.controller = _EveryOther(4)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5, 6, 7, 8]),
              SamplingParams(temperature=0.0, max_tokens=25, frequency_penalty=0.5, ignore_eos=True)]
    assert spec.async_scheduling
    _same(plain, spec, PROMPTS, params)


def test_decode_role_with_a_draft_model_equals_colocated(plain):
    """KV lands from a prefill engine (as the transfer layer writes it) for the target only; the
    draft catches up on the prompt it has. Tokens equal the colocated plain engine's."""
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = plain.generate(prompts, params)
    prefill = make_engine(draft_config(), role="prefill")
    assert prefill.spec is None                    # the prefill role ignores the config
    decode = make_engine(draft_config(), role="decode")
    assert run_disaggregated(prefill, decode, prompts, params) == [w.output_token_ids for w in want]
    stats = decode.stats().spec_decode
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
    assert decode.stats().kv_cache_usage == 0.0


def test_a_prefill_engine_with_a_draft_model_ships_its_kv_and_the_decode_draft_skips_its_prefill(plain):
    """The prefill engine computes the draft's KV of each prompt beside the target's (chunked: 90
    tokens over a 64-token budget), equal to the draft's own forward over the whole prompt; landed
    with the target's, the decode engine's draft runs only the tokens after the prompt, and the
    tokens equal the colocated plain engine's."""
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = plain.generate(prompts, params)
    prefill = make_engine(draft_config(), role="prefill", num_blocks=64)
    assert prefill.spec is None and prefill.draft_prefill is not None
    decode = make_engine(draft_config(), role="decode")
    runner, counted = decode.spec.draft.runner, []
    run_once = runner.run
    runner.run = lambda seqs, *a, **kw: counted.append(sum(len(s[1]) for s in seqs)) or run_once(seqs, *a, **kw)
    assert run_disaggregated(prefill, decode, prompts, params, draft_kv=True) == [w.output_token_ids for w in want]
    assert sum(counted) < sum(map(len, prompts))          # no catch-up over any prompt
    stats = decode.stats().spec_decode
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
    assert decode.stats().kv_cache_usage == 0.0
    # What was shipped is the draft's KV of the prompt: its own forward over it in one chunk.
    reference = make_engine(draft_config(), role="prefill", num_blocks=64).draft_prefill
    for rid, prompt in zip(("r0", "r1", "r2"), prompts):
        table = prefill.scheduler.held[rid].block_ids
        reference.run([ScheduledSeq(rid, tuple(prompt), 0, table, True)])
        n, size = len(prompt), 16
        for i, block in enumerate(table[:-(-n // size)]):
            rows = min(size, n - i * size)
            torch.testing.assert_close(prefill.draft_prefill.kv_cache[block][:, :, :rows],
                                       reference.kv_cache[block][:, :, :rows], rtol=1e-4, atol=1e-5)


def test_prefix_cache_hits_give_the_same_tokens_and_drafts(plain, draft):
    shared = _prompt(50, 70)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    (first,) = draft.generate([shared + [10, 11]], params)
    hits = draft.scheduler.kv_manager.num_hit_tokens
    before = draft.stats().spec_decode.copy()
    want, got = _same(plain, draft, [shared + [10, 11]], params)
    assert got[0].output_token_ids == first.output_token_ids
    assert draft.scheduler.kv_manager.num_hit_tokens > hits
    after = draft.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 0.95 * (
        after.num_draft_tokens - before.num_draft_tokens)


def test_the_adaptive_controller_as_shipped_gives_the_same_tokens(plain):
    spec = make_engine(NGRAM, forced=False)
    assert type(spec.spec.controller) is SpecController
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=21, max_tokens=40, ignore_eos=True)] * 2
    want = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert _summary(got) == _summary(want)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_verification_padded_to_the_graphs_width_equals_eager_and_the_plain_engine(plain, method):
    """The verification CUDA graphs' path on CPU (`engine.spec_decode.verify_graphs`, eager: the
    same padded forward a graph replays): every request padded to 1 + k tokens, the batch to a
    bucket. Output equals the eager speculative engine's and the plain engine's; no block leaks.
    With EAGLE the head reads the target's hidden states from the padded steps' buffer (only the
    real tokens' rows), so its drafts, too, are the eager engine's. Both engines are new: a shared
    one's prefix cache (earlier tests) would schedule other steps, so other drafts."""
    from engine.cuda_graphs import DecodeBuckets
    from engine.spec_decode.verify_graphs import VerifyBuckets, verify_shape

    config = NGRAM if method == "ngram" else eagle_config()
    eager, padded = make_engine(config), make_engine(config)
    runner, sched = padded.runner, padded.scheduler_config
    k, largest = verify_shape(padded.spec.config, sched.max_num_seqs, sched.max_num_batched_tokens)
    runner.decode_buckets = DecodeBuckets(runner._forward_into, padded.model_config.vocab_size, padded.dtype,
                                          runner.block_size, runner.device, min(sched.max_num_seqs, 64),
                                          runner.max_model_len, logits_rows=VerifyBuckets.logits_rows(k, largest))
    runner.verify_buckets = VerifyBuckets(runner.decode_buckets, k, largest, runner.max_model_len)
    if runner.hidden_sink is not None:     # as the runner allocates it when it builds the buckets
        import torch

        runner._hidden_buf = torch.empty(runner.decode_buckets.logits.shape[0], padded.model_config.hidden_size,
                                         dtype=padded.dtype)
    runs = []
    run = runner.verify_buckets.run
    runner.verify_buckets.run = lambda *args: (runs.append(args[1]), run(*args))[1]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=31, max_tokens=32, ignore_eos=True)] * 2
    verified = {"eager": [], "padded": []}        # every verification step's sequences, drafts included
    for name, engine in (("eager", eager), ("padded", padded)):
        verify = engine.spec.verify
        engine.spec.verify = lambda sampler, logits, seqs, *rest, _v=verify, _out=verified[name]: (
            _out.append([(tuple(s[1]), s[2]) for s in seqs]) or _v(sampler, logits, seqs, *rest))
    try:
        want, _ = _same(plain, padded, PROMPTS, params)
        assert _summary(eager.generate(PROMPTS, params)) == _summary(want)
    finally:
        del eager.spec.verify, padded.spec.verify
    assert runs and set(runs) <= {1, 2, 4}          # verification steps went through the padded buckets
    assert verified["padded"] == verified["eager"]  # the same drafts: the head read the same hidden states


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from tests.engine.hf_models import make_hf_model

    make_hf_model("llama_gqa", tmp_path / "other")           # vocab 300, the target's 260
    with pytest.raises(SpeculativeConfigError, match="vocabulary"):
        make_engine(SpeculativeConfig("draft_model", 2, model=str(tmp_path / "other")))


def test_no_block_leaks_after_random_aborts():
    """Requests come and go with drafts in every step (prompts over a 10-token alphabet: the n-gram
    lookup always finds a match), a pool small enough to preempt, and NUM_ABORTS aborts at random
    points; the pool's invariants hold throughout and every block is free at the end."""
    engine = make_engine(NGRAM, num_blocks=10, max_num_seqs=8)
    rng = random.Random(0)
    live: list[str] = []
    aborted = steps = 0
    while aborted < NUM_ABORTS:
        while len(live) < 8:
            rid = f"abort-{steps}-{len(live)}"
            prompt = [1] + [rng.randrange(3, 13) for _ in range(rng.randrange(1, 24))]
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 60),
                                    ignore_eos=True)
            engine.add_request(prompt, params, request_id=rid)
            live.append(rid)
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
        for rid in [r for r in live if rng.random() < 0.25]:
            assert engine.abort(rid)
            live.remove(rid)
            aborted += 1
        steps += 1
        if steps % 25 == 0:
            engine.scheduler.check_invariants()
    for rid in live:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check_invariants()
    pool = engine.scheduler.kv_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    stats = engine.stats()
    assert stats.spec_decode.num_drafts > NUM_ABORTS // 10 and stats.num_preemptions > 0


def test_structured_requests_beside_drafted_ones_equal_the_plain_engine(plain, draft):
    """Requests with a grammar get no drafts; in a speculative step their rows are masked and
    their grammars advanced as in a plain step, beside requests whose drafts are verified."""
    from tests.engine.structured_cases import check_complete, choice_spec, regex_spec

    specs = [regex_spec(), choice_spec()]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured=specs[0]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=24, structured=specs[1]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    want, got = _same(plain, draft, PROMPTS, params)
    check_complete(specs[0], got[0].text)
    check_complete(specs[1], got[2].text)


@pytest.mark.parametrize("name", ["mistral_window", "gemma3", "mixtral"])
def test_sliding_window_and_moe_models_equal_the_plain_engine(tmp_path, name):
    """Verification rows attend through each layer's window (Gemma 3: local and global layers);
    with every layer windowed (Mistral) the blocks behind the window are freed while drafts are
    in flight. The draft is the target's own checkpoint, so most steps emit several tokens.
    Mixtral (mixture of experts: verification rows routed to their experts like any token) with
    n-gram drafts."""
    if name == "mixtral":
        make_hf_model(name, tmp_path, seed=4)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(Path(_model["path"]) / file, tmp_path / file)
        drafts = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        from tests.engine.hf_window_models import make_window_model

        make_window_model(name, tmp_path)
        drafts = SpeculativeConfig("draft_model", 3, model=str(tmp_path))

    def engine(spec: SpeculativeConfig | None) -> Engine:
        e = Engine(EngineConfig(model=str(tmp_path), speculative=spec,
                                cache=CacheConfig(block_size=4, num_blocks=64),
                                scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)))
        if spec is not None:
            e.spec.controller = FixedController(spec.num_speculative_tokens)
        return e

    prompts = [_prompt(s, n) for s, n in ((5, 11), (6, 23), (7, 6))]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    _same(engine(None), engine(drafts), prompts, params)
