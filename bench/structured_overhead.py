"""Structured outputs: what a grammar costs per token, per mask, per compile and per P/D handoff.

Sections, each printed as one table (ratios are measured side by side in one run):

1. `tpot`: 100% JSON-schema traffic against unconstrained traffic on the engine (default the
   `tiny` preset on this device), at batch 1, 32 and 128: one engine per arm (`--arms`: `free`,
   `json`, and `free2`, a second unconstrained engine whose ratio to `free` is the noise floor of
   the measurement, A/A), the same batch in each, stepped in turns (`bench/interleaved.py`: each
   arm's clock is the sum of its own steps; the arms move to the next engine every round),
   `--repeats` rounds after a warm-up round; TPOT per round, and the median of the per-round
   ratios to `free`. The schema is a list of person
   records with at least `--max-tokens` records, so no structured request ends early and both
   batches stay full; free requests use `ignore_eos`.
2. `mask`: the host mask fill at a 128k vocabulary (llguidance over a byte-level BPE table of
   128256 tokens: 256 bytes, specials and 128k multi-byte pieces), µs per request-token, p50/p99,
   one matcher at a time and a batch of 32 / 128 rows in one parallel fill. Each matcher walks its
   grammar along uniformly random allowed tokens.
3. `compile`: compile time p50/p99, cold (a new compile) and warm (the LRU's cached compile plus
   the request's own matcher), over a set of typical schemas, a 200-property schema and a 128-tool
   call grammar (Lark, 128 alternatives each with `%json` arguments, as the router sends for
   `tool_choice=required`), at the 128k vocabulary.
4. `kernel` (not by default): `kernels.apply_grammar_mask` at batch 1 / 64 / 256 on `--device`.
5. `handoff`: a decode pod taking over a prefill pod's first token: fingerprint check, matcher,
   accept, and the first mask fill (`StructuredOutputs.accept_first_token` + `prepare`).
6. `validity` (not by default): seeded requests on every typical schema: how many end with
   `stop`, how many of those validate (`jsonschema`), how many end on `length` and how many of
   those in JSON whitespace (the default bound's job).

    .venv/bin/python bench/structured_overhead.py                     # everything, tiny preset
    .venv/bin/python bench/structured_overhead.py --sections mask compile handoff
    .venv/bin/python bench/structured_overhead.py --sections tpot --threads 1 --max-tokens 64 --repeats 9
    .venv/bin/python bench/structured_overhead.py --sections validity --threads 1 --validity-seeds 10
    python bench/structured_overhead.py --sections tpot kernel --device cuda --model <dir>   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.grammar.compiler import GrammarCompiler  # noqa: E402
from engine.grammar.llguidance_backend import LLGuidanceBackend  # noqa: E402
from engine.grammar.source import json_whitespace_options  # noqa: E402
from engine.grammar.spec import StructuredSpec, canonical_json  # noqa: E402
from engine.grammar.structured_outputs import StructuredOutputs  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer, _byte_to_unicode  # noqa: E402

VOCAB_128K = 128256
EOS = 2
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "city": {"enum": ["Paris", "Lagos", "Lima", "Osaka"]}, "vip": {"type": "boolean"}}}


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


# -- a realistic 128k token table ------------------------------------------------------------------

def build_bpe_128k(out_dir: Path, vocab_size: int = VOCAB_128K, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` tokens: specials, the 256 bytes, then pieces
    shaped like a real vocabulary's (words with and without a leading space, digit runs, JSON
    punctuation, indentation), in the model vocab (not added tokens, which llguidance's table
    build handles in quadratic time). No merges: encoding stays byte-wise, which the benchmark
    never needs; the mask work depends only on the token table."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    to_char = _byte_to_unicode()
    spell = lambda text: "".join(to_char[b] for b in text.encode())   # noqa: E731
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[to_char[b]] = len(vocab)
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    shapes = [lambda: "".join(rng.choice(letters) for _ in range(rng.randint(2, 9))),
              lambda: " " + "".join(rng.choice(letters) for _ in range(rng.randint(1, 9))),
              lambda: " " + "".join(rng.choice(letters) for _ in range(rng.randint(1, 7))).capitalize(),
              lambda: "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3))),
              lambda: "".join(rng.choice('{}[]",:. _-') for _ in range(rng.randint(2, 4))),
              lambda: "\n" + " " * rng.randint(0, 16)]
    while len(vocab) < vocab_size:
        piece = spell(rng.choice(shapes)())
        vocab.setdefault(piece, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))
    return out_dir


# -- the specs ---------------------------------------------------------------------------------------

def typical_schemas() -> list[dict]:
    """A JSONSchemaBench-like mix: flat records, nesting, arrays, enums, anyOf, $defs, patterns."""
    address = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
               "pattern": "^[0-9]{5}$"}, "country": {"enum": ["FR", "NG", "PE", "JP", "US"]}},
               "required": ["street", "country"]}
    schemas = [
        PERSON,
        {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
         "items": {"type": "string", "maxLength": 20}, "maxItems": 8}, "score": {"type": "number"}},
         "required": ["id"]},
        {"type": "object", "properties": {"user": PERSON, "address": address, "active": {"type": "boolean"}},
         "required": ["user", "address"]},
        {"type": "array", "items": address, "minItems": 1, "maxItems": 10},
        {"type": "object", "properties": {"result": {"anyOf": [{"type": "string"}, {"type": "integer"},
         {"type": "object", "properties": {"error": {"type": "string"}, "code": {"type": "integer"}},
          "required": ["error"]}]}}, "required": ["result"]},
        {"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string"}, "children": {
         "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["name"]}}, "$ref": "#/$defs/node"},
        {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
         "email": {"type": "string", "format": "email"}, "uuid": {"type": "string", "format": "uuid"}}},
        {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                          for i in range(20)}},
    ]
    rng = random.Random(1)
    for k in range(12):     # generated records of 3-8 fields
        props = {}
        for i in range(rng.randint(3, 8)):
            props[f"k{k}_{i}"] = rng.choice([{"type": "string", "maxLength": rng.randint(4, 40)},
                                             {"type": "integer", "minimum": 0, "maximum": 10 ** rng.randint(1, 6)},
                                             {"type": "boolean"}, {"enum": [f"v{j}" for j in range(rng.randint(2, 9))]},
                                             {"type": "array", "items": {"type": "number"}, "maxItems": 5}])
        schemas.append({"type": "object", "properties": props, "required": sorted(props)[:2]})
    return schemas


def wide_schema(num_properties: int = 200) -> dict:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "string"}}]
    props = {f"property_{i:03d}": kinds[i % len(kinds)] for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": sorted(props)[::3], "additionalProperties": False}


def tools_lark(num_tools: int = 128, seed: int = 2) -> str:
    """`tool_choice=required` in the hermes format: one or more `<tool_call>` blocks, each one of
    `num_tools` functions with its JSON-schema arguments (bounded whitespace inside)."""
    rng = random.Random(seed)
    options = json_whitespace_options(False)
    lines = ["start: call+", "call: \"<tool_call>\\n\" (" + " | ".join(f"t{i}" for i in range(num_tools))
             + ") \"\\n</tool_call>\""]
    for i in range(num_tools):
        params = {}
        for j in range(rng.randint(1, 6)):
            params[f"arg_{j}"] = rng.choice([{"type": "string", "description": "free text"},
                                             {"type": "integer", "minimum": 0}, {"type": "boolean"},
                                             {"enum": ["celsius", "fahrenheit"]},
                                             {"type": "array", "items": {"type": "string"}}])
        schema = {"type": "object", "properties": params, "required": sorted(params)[:1],
                  "additionalProperties": False, "x-guidance": options}
        name = json.dumps(f"function_{i}_{rng.choice(['get', 'set', 'list', 'find'])}")[1:-1]
        lines.append(f't{i}: "{{\\"name\\": \\"{name}\\", \\"arguments\\": " a{i} "}}"')
        lines.append(f"a{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def json_spec(schema: dict) -> StructuredSpec:
    return StructuredSpec("json_schema", canonical_json(schema))


# -- sections ----------------------------------------------------------------------------------------

def section_tpot(args) -> None:
    """Each arm's engine runs the same batch, stepped in turns (`bench.interleaved`); a round is
    one batch per arm, and its ratio is the arm's TPOT over the free arm's. `free2` is a second
    unconstrained arm: free2 / free is the noise floor of the same measurement (A/A). Use a
    multiple of the number of arms as `--repeats`, so every engine plays every arm equally."""
    from bench.interleaved import run_interleaved
    from engine.engine import Engine, EngineConfig

    arms = args.arms
    print(f"\n## TPOT, 100% JSON-schema traffic vs unconstrained ({args.model}, {args.max_tokens} tokens, "
          f"{torch.get_num_threads()} torch thread(s); arms {', '.join(arms)} interleaved step by step; "
          f"{args.repeats} rounds after a warm-up; ratios: medians of per-round ratios to free)")
    others = [a for a in arms if a != "free"]
    print(f"{'batch':>6} {'free ms':>8} " + " ".join(f"{a + ' x':>8} {'per round':>{6 * args.repeats}}"
                                                    for a in others) + f" {'json valid':>10}")
    records = {"type": "array", "items": PERSON, "minItems": args.max_tokens}    # never ends early
    spec = json_spec(records)
    for batch in args.batch:
        pool = [Engine(EngineConfig(model=args.model, device=args.device, detokenize=False,
                                    cache=CacheConfig(num_blocks=max(64, batch * 4)),
                                    scheduler=SchedulerConfig(max_num_seqs=max(batch, 1),
                                                              max_num_batched_tokens=max(512, batch * 16))))
                for _ in arms]
        for engine in pool:
            engine.structured.compile_future(spec).result()
        tpots: dict[str, list[float]] = {arm: [] for arm in arms}
        valid = True
        for r in range(-1, args.repeats):          # round -1: warm-up (first steps, allocator)
            # Two engines of the same code can differ by a few % (where their weights landed):
            # each round the arms move to the next engine, so each plays every arm in turn.
            engines = {arm: pool[(i + r) % len(pool)] for i, arm in enumerate(arms)}
            rng = random.Random(batch * 1000 + r)
            prompts = [[1] + [rng.randrange(4, 260) for _ in range(15)] for _ in range(batch)]
            params = [SamplingParams(temperature=1.0, seed=r * 1000 + i, max_tokens=args.max_tokens,
                                     ignore_eos=True) for i in range(batch)]
            per_arm = {arm: params if arm.startswith("free") else
                       [dataclasses.replace(p, ignore_eos=False, structured=spec) for p in params] for arm in arms}
            runs = run_interleaved(engines, prompts, per_arm)
            if r < 0:
                continue
            for arm, run in runs.items():
                tpots[arm].append(run.tpot)
            if "json" in runs:
                compiled = engines["json"].structured.compile_future(spec).result()
                for tokens in runs["json"].tokens.values():
                    matcher = compiled.matcher()
                    valid &= len(tokens) == args.max_tokens and all(matcher.accept(t) for t in tokens)
        cols = []
        for arm in others:
            ratios = [a / f for a, f in zip(tpots[arm], tpots["free"])]
            cols.append(f"{statistics.median(ratios):7.3f}x {','.join(f'{x:.2f}' for x in ratios):>{6 * args.repeats}}")
        print(f"{batch:>6} {statistics.median(tpots['free']) * 1e3:8.2f} " + " ".join(cols)
              + f" {str(valid) if 'json' in arms else '-':>10}", flush=True)
        for engine in pool:
            engine.close()


def section_kernel(args) -> None:
    """`kernels.apply_grammar_mask` on `--device` (Triton on CUDA, the torch reference on CPU)."""
    import kernels

    device = torch.device(args.device)
    print(f"\n## Mask kernel on {device} (µs per call, logits [batch, {args.vocab}] fp32, every row masked, "
          "half the tokens allowed)")
    print(f"{'batch':>6} {'median µs':>10}")
    gen = torch.Generator().manual_seed(0)
    words = (args.vocab + 31) // 32
    for batch in (1, 64, 256):
        logits = torch.randn(batch, args.vocab, generator=gen).to(device)
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (batch, words), generator=gen, dtype=torch.int64) \
            .to(torch.int32).to(device)
        rows = torch.arange(batch, device=device)
        samples = []
        for _ in range(args.kernel_iters + 3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            kernels.apply_grammar_mask(logits, bitmask, rows)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e6)
        print(f"{batch:>6} {statistics.median(samples[3:]):10.1f}")


def _walk(backend: LLGuidanceBackend, compiled, steps: int, rng: random.Random) -> list:
    """Matchers at `steps` positions along random walks (a new walk at each termination)."""
    states, matcher = [], compiled.matcher()
    mask = np.zeros((1, backend.words_per_row), dtype=np.int32)
    while len(states) < steps:
        if matcher.is_terminated():
            matcher = compiled.matcher()
        states.append(matcher.copy())
        backend.fill_bitmask([(matcher, 0)], mask)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
        allowed = allowed[allowed != EOS] if len(allowed) > 1 else allowed
        if not matcher.accept(int(rng.choice(allowed))):
            raise RuntimeError(matcher.error)
    return states


def section_mask(args, backend: LLGuidanceBackend) -> None:
    print(f"\n## Mask fill at a {backend.vocab_width}-token vocabulary (µs per request-token; "
          "random walks over the typical schemas and the 128-tool grammar)")
    rng = random.Random(0)
    specs = [json_spec(s) for s in typical_schemas()[:8]] + [StructuredSpec("lark", tools_lark())]
    states = [s for spec in specs for s in _walk(backend, backend.compile(spec), args.mask_steps, rng)]
    mask = np.zeros((128, backend.words_per_row), dtype=np.int32)
    single = []
    for state in states:
        t0 = time.perf_counter()
        backend.fill_bitmask([(state, 0)], mask)
        single.append((time.perf_counter() - t0) * 1e6)
    print(f"{'fill':<28} {'p50 µs':>9} {'p99 µs':>9}")
    print(f"{'one matcher per call':<28} {quantiles(single)[0]:9.1f} {quantiles(single)[1]:9.1f}")
    for batch in (32, 128):
        per_row = []
        for start in range(0, len(states) - batch + 1, batch):
            group = states[start:start + batch]
            t0 = time.perf_counter()
            backend.fill_bitmask([(m, j) for j, m in enumerate(group)], mask)
            per_row.append((time.perf_counter() - t0) * 1e6 / batch)
        p50, p99 = quantiles(per_row)
        print(f"{f'batch of {batch}, parallel':<28} {p50:9.1f} {p99:9.1f}   (per row; whole call p50 "
              f"{p50 * batch / 1e3:.2f} ms)")


def section_compile(args, backend: LLGuidanceBackend) -> None:
    print(f"\n## Compile time at a {backend.vocab_width}-token vocabulary (ms; cold = a new compile, "
          "warm = the cached compile + the request's matcher)")
    groups = {"typical schemas": [json_spec(s) for s in typical_schemas()],
              "200-property schema": [json_spec(wide_schema())],
              "128 tools (lark + %json)": [StructuredSpec("lark", tools_lark())]}
    compiler = GrammarCompiler(lambda: backend)
    print(f"{'specs':<28} {'n':>4} {'cold p50':>9} {'cold p99':>9} {'warm p50':>9} {'warm p99':>9}")
    for name, specs in groups.items():
        cold, warm = [], []
        for _ in range(args.compile_repeats):
            for spec in specs:
                t0 = time.perf_counter()
                backend.compile(spec)
                cold.append((time.perf_counter() - t0) * 1e3)
        for spec in specs:
            compiler.compile(spec).result()
            for _ in range(args.compile_repeats):
                t0 = time.perf_counter()
                compiler.compile(spec).result().matcher()
                warm.append((time.perf_counter() - t0) * 1e3)
        print(f"{name:<28} {len(cold):>4} {quantiles(cold)[0]:9.2f} {quantiles(cold)[1]:9.2f} "
              f"{quantiles(warm)[0]:9.3f} {quantiles(warm)[1]:9.3f}")
    compiler.close()


def section_handoff(args, backend: LLGuidanceBackend) -> None:
    print(f"\n## Decode pod's first-token handoff at a {backend.vocab_width}-token vocabulary (µs: fingerprint "
          "check + matcher + accept, then the first mask fill)")
    structured = StructuredOutputs(lambda: backend, backend.vocab_width, [EOS], torch.device("cpu"))
    print(f"{'spec':<28} {'accept p50':>11} {'accept p99':>11} {'+fill p50':>10} {'+fill p99':>10}")
    for name, spec in (("person record", json_spec(PERSON)), ("128 tools", StructuredSpec("lark", tools_lark()))):
        fingerprint = structured.fingerprint(spec)
        compiled = structured.compile_future(spec).result()
        mask = np.zeros((1, backend.words_per_row), dtype=np.int32)
        backend.fill_bitmask([(compiled.matcher(), 0)], mask)
        token = int(np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))[0])
        accept, total = [], []
        for i in range(args.handoff_repeats):
            request = Request(f"h{i}", [1, 5], SamplingParams(structured=spec))
            structured.add(request)
            t0 = time.perf_counter()
            structured.accept_first_token(request, token, fingerprint)
            t1 = time.perf_counter()
            request.append_output_token(token)
            structured.prepare([request])
            t2 = time.perf_counter()
            structured.forget([request.request_id])
            accept.append((t1 - t0) * 1e6)
            total.append((t2 - t0) * 1e6)
        print(f"{name:<28} {quantiles(accept)[0]:11.1f} {quantiles(accept)[1]:11.1f} "
              f"{quantiles(total)[0]:10.1f} {quantiles(total)[1]:10.1f}")
    structured.close()


def section_validity(args) -> None:
    """Issue 21's first target: every output that ends with `stop` validates, and `length`
    endings (a model running on in JSON whitespace until max_tokens) are about none. The random
    model's own choices are noise, so only the grammar can make its outputs valid: each typical
    schema, `--validity-seeds` seeded requests at temperature 1, `--validity-max-tokens` each, the
    text parsed with `json` and checked with `jsonschema` (formats not checked: llguidance's
    `format` support is its own). Greedy requests are not used: a random model's argmax often
    repeats one token, which says nothing about the grammar."""
    import jsonschema

    from engine.engine import Engine, EngineConfig

    schemas = typical_schemas()
    engine = Engine(EngineConfig(model=args.model, device=args.device,
                                 cache=CacheConfig(num_blocks=max(256, 8 * args.validity_seeds)),
                                 scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)))
    prompts, params, owners = [], [], []
    for s, schema in enumerate(schemas):
        spec = json_spec(schema)
        for seed in range(args.validity_seeds):
            rng = random.Random(s * 1000 + seed)
            prompts.append([1] + [rng.randrange(4, 260) for _ in range(15)])
            params.append(SamplingParams(temperature=1.0, seed=s * 1000 + seed,
                                         max_tokens=args.validity_max_tokens, structured=spec))
            owners.append(schema)
    outputs = engine.generate(prompts, params)
    engine.close()
    stops, valid, lengths, in_whitespace, invalid = 0, 0, 0, 0, []
    for schema, out in zip(owners, outputs):
        if out.finish_reason == "length":
            lengths += 1
            in_whitespace += out.text[-16:].isspace()     # its last 16 characters all whitespace
            continue
        stops += 1
        try:
            jsonschema.validate(json.loads(out.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            invalid.append(f"{out.text[:80]!r}: {str(e).splitlines()[0][:80]}")
    print(f"\n## Validity ({args.model}, {len(schemas)} typical schemas x {args.validity_seeds} seeded requests, "
          f"temperature 1, max_tokens {args.validity_max_tokens})")
    print(f"requests {len(outputs)}  stop {stops}  stop valid {valid} ({100 * valid / max(stops, 1):.1f}%)  "
          f"length {lengths} ({100 * lengths / len(outputs):.1f}%), of them ending in whitespace {in_whitespace}")
    for line in invalid[:10]:
        print(f"  invalid: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["tpot", "mask", "compile", "handoff"],
                        choices=["tpot", "kernel", "mask", "compile", "handoff", "validity"])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu", help="tpot and kernel sections")
    parser.add_argument("--kernel-iters", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=6, help="tpot rounds (after a warm-up round)")
    parser.add_argument("--arms", nargs="+", default=["free", "json", "free2"], help="tpot arms: free (the "
                        "reference, first), json (100%% constrained), free2 (free again: the A/A noise floor)")
    parser.add_argument("--validity-seeds", type=int, default=10, help="requests per schema (validity)")
    parser.add_argument("--validity-max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mask-steps", type=int, default=120, help="walk positions per spec")
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--handoff-repeats", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=VOCAB_128K)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "tpot" in args.sections:
        section_tpot(args)
    if "kernel" in args.sections:
        section_kernel(args)
    if "validity" in args.sections:
        section_validity(args)
    others = [s for s in args.sections if s not in ("tpot", "kernel", "validity")]
    if others:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            tokenizer = Tokenizer.from_pretrained(build_bpe_128k(Path(tmp), args.vocab))
            backend = LLGuidanceBackend(tokenizer, args.vocab, [EOS], num_threads=args.threads)
            print(f"\n(token table of {args.vocab} tokens built in {time.perf_counter() - t0:.1f} s, "
                  f"{args.threads} fill thread(s))")
            for name in others:
                {"mask": section_mask, "compile": section_compile, "handoff": section_handoff}[name](args, backend)


if __name__ == "__main__":
    main()
