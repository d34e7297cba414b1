#!/usr/bin/env bash
# GPU check: one prepared run on a lent H200 (device tool), under 8 minutes, ONE table at the end.
#
# The sections and their time caps are in bench/gpu_check_sections.txt, in order of value (the
# graphs == eager == async test first, then the decode step with and without graphs, the other
# GPU tests and the kernels, offline throughput, FP8, goodput last), one plan per kind of run:
#   full   the first GPU run (default): every row of the table in 480 s
#   fp8    GPU_CHECK_ONLY=fp8: the FP8 comparison and colocated goodput, 480 s
#   smoke  GPU_CHECK_SMOKE=1: every section's plumbing on CPU with the tiny preset (the GPU tests skip)
# tests/bench/test_gpu_check.py fails when a plan's caps add up to more than its budget. Each section
# runs under `timeout -s INT -k 10` for its cap or what is left before the deadline (less the kill
# grace), whichever is less, so the script never passes its deadline; SIGINT lets pytest print its
# summary and a benchmark its traceback. A section that no longer fits is skipped and says so; a
# failure is recorded and the next section runs. pytest runs with -v -rA --continue-on-collection-errors
# (and -n 4 --dist loadfile where pytest-xdist is installed, as on the device image).
#
# The Triton cache: TRITON_CACHE_DIR points at the work folder's triton-cache, which leaves as
# $OUT/triton_cache.tar.gz (split into .partNN pieces under 15 MB when larger) and comes back when
# carried: copy the returned files into .gpu_check/ (ignored) and carry that folder. Same image,
# same Triton: every compile of one run is a cache hit on the next.
#
# Output: the table on stdout (last), and under $OUT (else under the work folder it names):
#   gpu_check.md           the table, with versions and settings above it
#   gpu_check.log          every section's log, one after the other
#   gpu_check_logs.tar.gz  the work folder: logs, JSON, goodput plots and pod logs
#   triton_cache.tar.gz    the Triton cache (or triton_cache.tar.gz.part00, .part01, ...)
#
# Before the device call (here, once; wheels for Python 3.12, versions as installed in .venv):
#   echo /.whl/ >> .git/info/exclude; echo /.gpu_check/ >> .git/info/exclude   # if not there yet
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --prepare-wheels
# which runs `pip download` for the names in WHEELS below at the .venv's versions. Why these: the
# router imports fastapi (-> starlette, pydantic, pydantic-core, annotated-types, annotated-doc,
# typing-inspection, opentelemetry-api), uvicorn, and the pods grpc_health
# (grpcio-health-checking); wire was generated for grpcio >= 1.85.1 and protobuf >= 7.35.1,
# newer than the image may hold; pydantic-core needs typing-extensions >= 4.16; fastapi anyio >= 4.1.
# The image already has click, h11, httpx, httpcore, jinja2, prometheus-client, transformers and
# pytest-xdist. About 11 MB. This script installs them itself (into /tmp/site, first on
# PYTHONPATH) when .whl exists; its preflight section says within seconds what is still missing.
#
# The device call (one; the script keeps itself under 8 minutes, the rest is start-up and copies):
#   run(command="bash bench/gpu_check.sh", carry=[".whl", ".gpu_check"], timeout_s=560)
# then copy the returned files into .gpu_check/ (the next run's Triton cache) and call give_back.
# Paste the table into docs/benchmarks.md, section "GPU check (bench/gpu_check.sh)".
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

PLAN=full
[ "${GPU_CHECK_ONLY:-}" = fp8 ] && PLAN=fp8
[ "${GPU_CHECK_SMOKE:-0}" = 1 ] && PLAN=smoke
SECTIONS_FILE=$ROOT/bench/gpu_check_sections.txt
KILL_GRACE=10                    # seconds between timeout's SIGINT and its SIGKILL
budget_line=$(grep "^budget|$PLAN|" "$SECTIONS_FILE") || { echo "no plan $PLAN in $SECTIONS_FILE" >&2; exit 2; }
IFS='|' read -r _ _ PLAN_BUDGET RESERVE <<< "$budget_line"
BUDGET=${GPU_CHECK_BUDGET_S:-$PLAN_BUDGET}
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

# The Triton cache: the last run's when carried back (see the header), else a cold one.
export TRITON_CACHE_DIR=$WORK/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".gpu_check/triton_cache.tar.gz*" > /dev/null; then
    # shellcheck disable=SC2046
    if cat $(ls .gpu_check/triton_cache.tar.gz* | sort) | tar xzf - -C "$TRITON_CACHE_DIR" 2> "$WORK/cache.log"; then
        say "Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from .gpu_check"
    else
        say "Triton cache in .gpu_check did not unpack (see cache.log): starting cold"
    fi
else
    say "Triton cache: cold (no .gpu_check/triton_cache.tar.gz)"
fi

PYTEST="$PY -m pytest -v -rA --continue-on-collection-errors -p no:cacheprovider"
XDIST=""
"$PY" -c "import xdist" 2> /dev/null && XDIST="-n 4 --dist loadfile"

# run_section ID NAME CAP_S MIN_S ARTIFACT COMMAND: runs COMMAND (stdout+stderr to ID.log) under
# `timeout -s INT -k KILL_GRACE` for CAP_S or what is left before the deadline, whichever is less;
# skips it when fewer than MIN_S are left. ARTIFACT: the file (in WORK) the table reads, "-": none.
run_section() {
    local id=$1 name=$2 cap=$3 min=$4 artifact=$5 command=$6
    local left=$((DEADLINE - SECONDS - RESERVE - KILL_GRACE)) limit status rc t0
    [ "$artifact" = - ] && artifact=""
    if [ "$left" -lt "$min" ]; then
        echo "out of time: ${left} s left of the ${BUDGET} s budget, needs ${min} s" > "$WORK/$id.log"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$name" skipped 0 "$id.log" "" >> "$WORK/sections.tsv"
        say "$id: skipped (${left} s left)"
        return
    fi
    limit=$((cap < left ? cap : left))
    say "$id: $name (limit ${limit} s): $command"
    t0=$SECONDS
    timeout -s INT -k "$KILL_GRACE" "$limit" bash -c "$command" > "$WORK/$id.log" 2>&1
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
export -f goodput_config   # the sections run under `bash -c`
export PY WORK PYTEST XDIST

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)'), plan $PLAN, budget ${BUDGET} s"
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
tee -a "$PROGRESS" < "$WORK/env.txt"
DEV=$([ "$PLAN" = smoke ] && echo cpu || echo cuda)

while IFS='|' read -r kind plan id cap min artifact name command; do
    [ "$kind" = section ] && [ "$plan" = "$PLAN" ] || continue
    run_section "$id" "$name" "$cap" "$min" "$artifact" "$command" < /dev/null
done < "$SECTIONS_FILE"

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
tar czf "$TAR.tmp" -C "$WORK" --exclude='./gpu_check*' --exclude=./triton-cache . 2>/dev/null
if [ "$(stat -c %s "$TAR.tmp" 2>/dev/null || echo 0)" -gt 15000000 ]; then   # $OUT takes 16 MB a file
    tar czf "$TAR.tmp" -C "$WORK" --exclude='./gpu_check*' --exclude=./triton-cache --exclude=./goodput-logs . \
        2>/dev/null
fi
mv -f "$TAR.tmp" "$TAR"
# The Triton cache, for the next run (see the header): one file, or pieces under $OUT's 16 MB a file.
CACHE_TAR=$DEST/triton_cache.tar.gz
rm -f "$CACHE_TAR" "$CACHE_TAR".part*
tar czf "$CACHE_TAR" -C "$TRITON_CACHE_DIR" . 2>/dev/null
if [ "$(stat -c %s "$CACHE_TAR" 2>/dev/null || echo 0)" -gt 45000000 ]; then   # $OUT takes 64 MB in all
    # Without the intermediate IRs: a cache hit reads the binary and the metadata.
    tar czf "$CACHE_TAR" -C "$TRITON_CACHE_DIR" --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' \
        --exclude='*.source' . 2>/dev/null
fi
if [ "$(stat -c %s "$CACHE_TAR" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    split -b 15000000 -d -a 2 "$CACHE_TAR" "$CACHE_TAR.part" && rm -f "$CACHE_TAR"
fi
say "Triton cache out: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files, $(du -ch "$CACHE_TAR"* 2>/dev/null | tail -1 | cut -f1)"
say "done in ${SECONDS} s; files in $DEST"
echo
cat "$DEST/gpu_check.md"
