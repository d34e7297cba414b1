#!/usr/bin/env bash
# Serving path side by side with vLLM-CPU, on one model, one configuration after the other:
#   bash bench/serving_compare.sh [OLD_TREE]     (OLD_TREE: a worktree of an older commit, optional)
# vLLM-CPU (../shared/peers/vllm_cpu.sh setup, once), then cbserve colocated (2 threads) and
# 1P+1D from this tree (and from OLD_TREE), each with `vllm bench serve` at saturation and at
# 8 req/s (256 in / 64 out, 200 prompts, greedy, EOS ignored). At saturation cbserve's SLOs are
# relaxed so admission control queues rather than sheds, as vLLM does. Prints one line per run.
# CONFIGS="colocated 1p1d" (default) picks cbserve's configurations; VLLM=0 skips vLLM.
set -u
MODEL=${MODEL:-$HOME/.cache/cbserve/models/tiny-v2}
PEER=${PEER:-$(cd "$(dirname "$0")/../.." && pwd)/shared/peers/vllm_cpu.sh}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
OUTD=${OUTD:-$(mktemp -d)}; mkdir -p "$OUTD"
RELAX="--slo-ttft-ms 600000 --slo-tpot-ms 60000"
wait_up() { for _ in $(seq 1 150); do sleep 2; curl -s "localhost:$1/v1/models" >/dev/null && return 0; done; return 1; }
bench() {  # name port
    bash "$PEER" bench "$MODEL" "$2" "$OUTD/$1_inf.json" inf 200 > "$OUTD/$1_inf.log" 2>&1
    bash "$PEER" bench "$MODEL" "$2" "$OUTD/$1_r8.json" 8 200 > "$OUTD/$1_r8.log" 2>&1
}
cbserve() {  # name tree port flags...
    local name=$1 tree=$2 port=$3; shift 3
    (cd "$tree" && PYTHONPATH=$tree "$PY" -m cbserve.cli up --model "$MODEL" --port "$port" $RELAX "$@" \
        > "$OUTD/$name.server.log" 2>&1) & local pid=$!
    wait_up "$port" && bench "$name" "$port"
    pkill -INT -P "$pid" 2>/dev/null; kill -INT "$pid" 2>/dev/null; sleep 8; pkill -9 -P "$pid" 2>/dev/null
}
CONFIGS=${CONFIGS:-colocated 1p1d}
if [ "${VLLM:-1}" != 0 ]; then
    bash "$PEER" serve "$MODEL" 8100 > "$OUTD/vllm.server.log" 2>&1 &
    wait_up 8100 && bench vllm 8100
    pkill -f "vllm serve"; sleep 5
fi
for tree in ${1:-} "$HERE"; do
    tag=$([ "$tree" = "$HERE" ] && echo new || echo old)
    case " $CONFIGS " in *" colocated "*) cbserve "$tag-colocated" "$tree" 8101 --colocated 1 --threads-per-pod 2;; esac
    case " $CONFIGS " in *" 1p1d "*) cbserve "$tag-1p1d" "$tree" 8102 --prefill 1 --decode 1;; esac
done
for log in "$OUTD"/*_inf.log "$OUTD"/*_r8.log; do
    printf '%-28s ' "$(basename "$log" .log)"
    grep -E "Successful|Output token throughput|Mean TTFT|Median TPOT|P99 TPOT" "$log" | tr -s ' ' | tr '\n' ';'
    echo
done
echo "logs and JSON in $OUTD"
