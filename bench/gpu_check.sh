#!/usr/bin/env bash
# GPU check: one prepared run on a lent H200 (device tool), under 8 minutes, ONE table at the end.
#
# Sections, each under its own `timeout` and never past a global deadline (GPU_CHECK_BUDGET_S,
# default 460 s), numbered as in the table; a failure is recorded and the next section runs:
#   1 tests       pytest -q -m gpu tests/kernels tests/kvtransfer tests/engine
#   2 kernels     bench/kernel_bandwidth.py (Llama-3-8B-like shapes, bf16)
#   3 decode      bench/decode_step.py --shape 1b, then 1b --enforce-eager (batch 1/64: no CUDA
#                 graphs), then 8b: batch 1/8/64/256 at context 256, with the bound (weights + K/V read) / (device-to-device copy bandwidth measured there)
#   4 throughput  bench/throughput.py --shape 1b: 512 prompts (in 32-512, out 16-256) vs
#                 transformers generate() at batch 128; 8b with 128 prompts if time is left (last)
#   5 goodput     bench/goodput.py through `cbserve up`'s LocalCluster on the 1b shape, chat mix,
#                 2 rates x 15 s: pd-goodput (1P+1D) then colocated-2, every pod on the one GPU
#   3/4 fp8       the 8b shape with --quantization fp8 --kv-cache-dtype fp8 (e4m3 weights through
#                 torch._scaled_mm, e4m3 KV): decode step at batch 1 and 64 (its setup row gives the
#                 weights' memory), offline throughput without transformers; compare with the bf16
#                 rows of the same sections (targets: weights <= 9 GB, batch-1 step <= 0.6x bf16's,
#                 throughput >= 1.5x bf16's)
# Run order (priority): 1, 2, 3 (1b), 3 (8b), 4 (1b), 5, 4 (8b), 3 (8b fp8), 4 (8b fp8); a section
# that no longer fits before the deadline is skipped and says so. The shape checkpoints are cached
# under ~/.cache/cbserve/models/llama-3.2-1b-shape-v1 and llama-3.1-8b-shape-v1 (2.5 and 15 GB).
#
# GPU_CHECK_ONLY=fp8 runs only the FP8 comparison (budget 480 s; run(..., timeout_s=560)): the fp8
# GPU tests, the 8b decode step at batch 1 and 64 in bf16 then in fp8 (the first builds the 8b
# checkpoint), then 8b offline throughput (128 prompts, no transformers, both with a 32 GiB KV
# cache budget: fp8 fits twice the tokens in it) in bf16 then in fp8.
#
# Output: the table on stdout (last), and under $OUT (else under the work folder it names):
#   gpu_check.md           the table, with versions and settings above it
#   gpu_check.log          every section's log, one after the other
#   gpu_check_logs.tar.gz  the work folder: logs, JSON, goodput plots and pod logs
#
# Before the device call (here, once; wheels for Python 3.12, versions as installed in .venv):
#   echo /.whl/ >> .git/info/exclude      # if not there yet; the folder must stay untracked
#   bash bench/gpu_check.sh --prepare-wheels
# which runs, for the names below at the .venv's versions:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     -d .whl fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
#     annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 \
#     opentelemetry-api==1.45.2 uvicorn==0.54.0 anyio==4.16.0 grpcio==1.85.3 \
#     grpcio-health-checking==1.85.1 protobuf==7.36.2
# Why these: the router imports fastapi (-> starlette, pydantic, pydantic-core, annotated-types,
# annotated-doc, typing-inspection, opentelemetry-api), uvicorn, and the pods grpc_health
# (grpcio-health-checking); wire was generated for grpcio >= 1.85.1 and protobuf >= 7.35.1,
# newer than the image may hold; pydantic-core needs typing-extensions >= 4.16; fastapi anyio >= 4.1.
# The image already has click, h11, httpx, httpcore, jinja2, prometheus-client, transformers.
# About 11 MB. This script installs them itself (into /tmp/site, first on PYTHONPATH) when .whl exists.
#
# The device call (one; the script keeps itself under 8 minutes, the rest is start-up and copies):
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
# No rerun fits in a 15-minute device budget after a machine start: call give_back afterwards.
# Then paste the table into docs/benchmarks.md, section "GPU check (bench/gpu_check.sh)".
#
# Locally, without a GPU: GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh runs every section on the
# tiny preset on the CPU, with small sizes (the GPU tests skip), to check the plumbing.
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
        typing-extensions opentelemetry-api uvicorn anyio grpcio grpcio-health-checking protobuf)

if [ "${1:-}" = "--prepare-wheels" ]; then
    venv_py=${PYTHON:-$ROOT/.venv/bin/python}
    specs=$("$venv_py" - "${WHEELS[@]}" <<'EOF'
import importlib.metadata as m, sys
print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
EOF
) || exit 1
    mkdir -p .whl && rm -f .whl/*.whl
    echo "downloading: $specs"
    # shellcheck disable=SC2086
    "$venv_py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $specs || exit 1
    git check-ignore -q .whl || echo "warning: .whl is not ignored: add /.whl/ to .git/info/exclude" >&2
    ls -l .whl && du -sh .whl
    exit 0
fi

SMOKE=${GPU_CHECK_SMOKE:-0}
ONLY=${GPU_CHECK_ONLY:-}
BUDGET=${GPU_CHECK_BUDGET_S:-$([ "$ONLY" = fp8 ] && echo 480 || echo 460)}
RESERVE=12                       # seconds kept for the table and the copies at the end
DEADLINE=$((SECONDS + BUDGET))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
DEST=${OUT:-$WORK}
mkdir -p "$DEST"
PROGRESS=$WORK/progress.txt
: > "$WORK/sections.tsv"
export PYTHONUNBUFFERED=1

say() { echo "# $(date -u +%H:%M:%S) [${SECONDS}s] $*" | tee -a "$PROGRESS"; }

# The carried wheels (see the header), ahead of the image's packages for every child process.
if compgen -G ".whl/*.whl" > /dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl > "$WORK/wheels.log" 2>&1; then
        export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
        say "installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    else
        say "wheel install FAILED (see wheels.log); sections that need the router will fail"
    fi
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# run_section ID NAME CAP_S MIN_S ARTIFACT CMD...: runs CMD (stdout+stderr to ID.log) under
# `timeout` for CAP_S or what is left before the deadline, whichever is less; skips it when
# fewer than MIN_S are left. ARTIFACT: the file (in WORK) the table reads figures from.
run_section() {
    local id=$1 name=$2 cap=$3 min=$4 artifact=$5
    shift 5
    local left=$((DEADLINE - SECONDS - RESERVE)) limit status rc t0
    if [ "$left" -lt "$min" ]; then
        echo "out of time: ${left} s left of the ${BUDGET} s budget, needs ${min} s" > "$WORK/$id.log"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$name" skipped 0 "$id.log" "" >> "$WORK/sections.tsv"
        say "$id: skipped (${left} s left)"
        return
    fi
    limit=$((cap < left ? cap : left))
    say "$id: $name (limit ${limit} s): $*"
    t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$WORK/$id.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="timeout ${limit}s" ;;
        *) status="failed rc=$rc" ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$name" "$status" "$((SECONDS - t0))" "$id.log" "$artifact" \
        >> "$WORK/sections.tsv"
    say "$id: $status after $((SECONDS - t0)) s"
}

# goodput_config CONFIG SHAPE_OR_MODEL DEVICE ARGS...: the model directory, then one bench/goodput.py config.
goodput_config() {
    local config=$1 model=$2 device=$3
    shift 3
    if [ "$model" != tiny ]; then
        model=$("$PY" -m bench.shapes "$model" --device "$device") || return 1
    fi
    "$PY" -m bench.goodput --model "$model" --device "$device" --mixes chat --configs "$config" \
        --json "$WORK/goodput-$config.json" --out-dir "$WORK/plots" --log-dir "$WORK/goodput-logs" "$@"
}
export -f goodput_config   # `timeout` runs programs: the sections call it through `bash -c`
export PY WORK

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -2
    else
        echo "no nvidia-smi"
    fi
    "$PY" - <<'EOF' 2>&1
import importlib, platform
names = ["torch", "triton", "transformers", "fastapi", "uvicorn", "pydantic", "grpc", "google.protobuf"]
versions = []
for name in names:
    try:
        versions.append(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - report, do not stop
        versions.append(f"{name} MISSING ({type(e).__name__})")
import torch
print(f"python {platform.python_version()}; " + ", ".join(versions) + f"; cuda available: {torch.cuda.is_available()}")
EOF
} > "$WORK/env.txt"
cat "$WORK/env.txt" | tee -a "$PROGRESS"

if [ "$SMOKE" = 1 ]; then
    DEV=cpu
    run_section tests "gpu tests" 120 10 "" "$PY" -m pytest -q -m gpu tests/kernels tests/kvtransfer tests/engine -p no:cacheprovider
    run_section kernels "kernel bandwidth" 60 10 "" "$PY" bench/kernel_bandwidth.py
    run_section decode-tiny "decode step" 90 10 decode-tiny.log \
        "$PY" bench/decode_step.py --shape tiny --device cpu --batch 1,2 --context 32 --steps 5 --warmup 2 --json
    run_section throughput-tiny "offline throughput" 90 10 throughput-tiny.log \
        "$PY" bench/throughput.py --model tiny --device cpu --num-prompts 4 --input-len 8 32 --output-len 4 8 \
        --hf-batch-size 2 --kv-cache-mb 0 --json
    run_section goodput-pd "goodput (1P+1D)" 150 30 goodput-pd-goodput.json \
        bash -c 'goodput_config "$@"' _ pd-goodput tiny cpu --rates 1 --duration 5 --warmup 1
    run_section goodput-colocated "goodput (colocated-2)" 150 30 goodput-colocated-2.json \
        bash -c 'goodput_config "$@"' _ colocated-2 tiny cpu --rates 1 --duration 5 --warmup 1
    run_section decode-tiny-fp8 "decode step (fp8)" 90 10 decode-tiny-fp8.log \
        "$PY" bench/decode_step.py --shape tiny --device cpu --batch 1,2 --context 32 --steps 5 --warmup 2 \
        --quantization fp8 --kv-cache-dtype fp8 --json
elif [ "$ONLY" = fp8 ]; then
    DEV=cuda
    FP8=(--quantization fp8 --kv-cache-dtype fp8)
    THROUGHPUT_8B=(--shape 8b --device cuda --num-prompts 128 --max-num-seqs 256 --max-num-batched-tokens 8192
                   --kv-cache-mb 32768 --skip-hf --json)
    run_section tests "gpu tests (fp8)" 60 30 "" "$PY" -m pytest -q -m gpu -k "fp8 or scaled_mm" tests/kernels \
        tests/kvtransfer tests/engine -p no:cacheprovider
    run_section decode-8b "decode step" 150 60 decode-8b.log \
        "$PY" bench/decode_step.py --shape 8b --device cuda --batch 1,64 --context 256 --json
    run_section decode-8b-fp8 "decode step (fp8)" 90 60 decode-8b-fp8.log \
        "$PY" bench/decode_step.py --shape 8b --device cuda --batch 1,64 --context 256 "${FP8[@]}" --json
    run_section throughput-8b "offline throughput" 90 60 throughput-8b.log "$PY" bench/throughput.py "${THROUGHPUT_8B[@]}"
    run_section throughput-8b-fp8 "offline throughput (fp8)" 90 60 throughput-8b-fp8.log \
        "$PY" bench/throughput.py "${THROUGHPUT_8B[@]}" "${FP8[@]}"
else
    DEV=cuda
    run_section tests "gpu tests" 100 30 "" "$PY" -m pytest -q -m gpu tests/kernels tests/kvtransfer tests/engine -p no:cacheprovider
    run_section kernels "kernel bandwidth" 60 20 "" "$PY" bench/kernel_bandwidth.py
    run_section decode-1b "decode step" 90 40 decode-1b.log \
        "$PY" bench/decode_step.py --shape 1b --device cuda --batch 1,8,64,256 --context 256 --json
    # The same steps without CUDA graphs: what the graphs and the fused kernels save at small batch.
    run_section decode-1b-eager "decode step" 60 30 decode-1b-eager.log \
        "$PY" bench/decode_step.py --shape 1b --device cuda --batch 1,64 --context 256 --enforce-eager --json
    run_section decode-8b "decode step" 120 60 decode-8b.log \
        "$PY" bench/decode_step.py --shape 8b --device cuda --batch 1,8,64,256 --context 256 --json
    run_section throughput-1b "offline throughput" 120 60 throughput-1b.log \
        "$PY" bench/throughput.py --shape 1b --device cuda --num-prompts 512 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --kv-cache-mb 0 --hf-batch-size 128 --json
    # A fixed KV cache per pod (8192 blocks = 2 GiB on the 1b shape): two pods share the GPU.
    run_section goodput-pd "goodput (1P+1D)" 90 50 goodput-pd-goodput.json \
        bash -c 'goodput_config "$@"' _ pd-goodput 1b cuda --num-blocks 8192 --rates 4 16 --duration 15
    run_section goodput-colocated "goodput (colocated-2)" 90 50 goodput-colocated-2.json \
        bash -c 'goodput_config "$@"' _ colocated-2 1b cuda --num-blocks 8192 --rates 4 16 --duration 15
    # A fixed 32 GiB KV cache: transformers' 8b copy must fit even if the engine's memory lingers.
    run_section throughput-8b "offline throughput" 100 60 throughput-8b.log \
        "$PY" bench/throughput.py --shape 8b --device cuda --num-prompts 128 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --kv-cache-mb 32768 --hf-batch-size 128 --json
    # FP8 (e4m3 weights and KV) on the 8b shape, against the bf16 rows above; last: most likely skipped
    # in a full run, GPU_CHECK_ONLY=fp8 runs these alone.
    run_section decode-8b-fp8 "decode step (fp8)" 90 60 decode-8b-fp8.log \
        "$PY" bench/decode_step.py --shape 8b --device cuda --batch 1,64 --context 256 \
        --quantization fp8 --kv-cache-dtype fp8 --json
    run_section throughput-8b-fp8 "offline throughput (fp8)" 100 60 throughput-8b-fp8.log \
        "$PY" bench/throughput.py --shape 8b --device cuda --num-prompts 128 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --kv-cache-mb 32768 --skip-hf --quantization fp8 --kv-cache-dtype fp8 --json
fi

TABLE=$("$PY" bench/gpu_check_table.py "$WORK" 2> "$WORK/table.err") || TABLE="(table failed: $(tail -3 "$WORK/table.err"))"
{
    echo "## GPU check ($DEV), $(head -1 "$WORK/env.txt")"
    echo
    sed -n '2,$p' "$WORK/env.txt" | sed 's/^/    /'
    echo
    echo "$TABLE"
} > "$DEST/gpu_check.md"
for f in "$PROGRESS" "$WORK"/*.log; do
    echo "===== $(basename "$f")"
    cat "$f"
done > "$DEST/gpu_check.log" 2>&1
TAR=$DEST/gpu_check_logs.tar.gz
tar czf "$TAR.tmp" -C "$WORK" --exclude='./gpu_check*' . 2>/dev/null
if [ "$(stat -c %s "$TAR.tmp" 2>/dev/null || echo 0)" -gt 15000000 ]; then   # $OUT takes 16 MB a file
    tar czf "$TAR.tmp" -C "$WORK" --exclude='./gpu_check*' --exclude=./goodput-logs . 2>/dev/null
fi
mv -f "$TAR.tmp" "$TAR"
say "done in ${SECONDS} s; files in $DEST"
echo
cat "$DEST/gpu_check.md"
