#!/usr/bin/env bash
# One call on a lent GPU node: set up from what the call carried, run one task inside the
# call's time limit, and pack what it made into $OUT, the folder that comes back.
# docs/gpu-results.md ("Recording the grids") has the plan these calls follow.
#
#   bench/gpu_call.sh grid MODEL GLOBAL_BATCH [STOP_AFTER] [-- record_grid.py options]
#       record MODEL's grid into $GRIDS/$NODE/MODEL, resumed where the carried folder stops,
#       starting no probe predicted to end after STOP_AFTER (default 8m); grid.tar.gz, grid.log
#   bench/gpu_call.sh run MODEL GLOBAL_BATCH BUDGET [-- autotune run options]
#       autotune run into $RUNS/MODEL.db (resumed if carried back); run.tar.gz, run.json, run.log
#   bench/gpu_call.sh overhead [MODEL]
#       the per-probe overhead split (bench/probe_overhead.py); overhead.txt
#   bench/gpu_call.sh noise [STOP_AFTER] [-- repeat_noise.py options]
#       one point's spread between repeated probes and within a probe
#       (bench/repeat_noise.py, default 5m); noise.tar.gz, noise.log, the GPU's clocks in gpu.csv
#
# Carry wheelhouse/ (make wheelhouse: what the node's image lacks) and .ext/ (DeepSpeed's
# built ops, brought back as ext.tar.gz and unpacked into .ext/ here, so the next machine
# need not build them again). Each task stops itself LIMIT seconds (default 540) after the
# call started, whatever happens, and packs what it has.
set -uo pipefail

task=${1:?usage: bench/gpu_call.sh grid|run|overhead|noise ... (see the head of this file)}
shift
: "${OUT:?OUT: the folder whose files come back}"
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GRIDS=${GRIDS:-$ROOT/bench/data}
RUNS=${RUNS:-$ROOT/runs}
LIMIT=${LIMIT:-540}
WHEELS=${WHEELS:-$ROOT/wheelhouse}
started=$SECONDS
cd "$ROOT" || exit 2

if [ -z "${NODE:-}" ]; then
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    case $gpu in
        *H100*) NODE=h100 ;;
        *H200*) NODE=h200 ;;
        *) NODE=other ;;
    esac
fi

export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=$ROOT/.ext
mkdir -p "$TORCH_EXTENSIONS_DIR"
if [ -d "$WHEELS" ]; then
    if [ ! -f /tmp/site/.installed ]; then
        # autotune itself runs from this checkout, never from a wheel; what the node's image
        # already holds (torch's numpy among them) is not shadowed
        wheels=()
        for wheel in "$WHEELS"/*.whl; do
            case ${wheel##*/} in
                autotune-* | numpy-* | packaging-* | pyyaml-* | tqdm-* | markupsafe-* | \
                    pygments-* | rich-* | typer-* | psutil-* | nvidia_ml_py-* | \
                    markdown_it_py-* | mdurl-* | shellingham-* | annotated_doc-* | psycopg*) ;;
                *) wheels+=("$wheel") ;;
            esac
        done
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "${wheels[@]}" || exit 2
        # DeepSpeed's sources were just written: make the carried op builds newer, so the
        # build tool finds them up to date
        find "$TORCH_EXTENSIONS_DIR" -type f -exec touch {} + 2>/dev/null
        touch /tmp/site/.installed
    fi
    export PYTHONPATH=/tmp/site:$ROOT
else
    export PYTHONPATH=$ROOT
fi

left() { echo $((LIMIT - (SECONDS - started))); }

pack_ext() {
    if [ -n "$(ls -A "$TORCH_EXTENSIONS_DIR")" ]; then
        tar czf "$OUT/ext.tar.gz" -C "$TORCH_EXTENSIONS_DIR" \
            --exclude='*.lock' --exclude=autotune-ops.lock .
    fi
}

case $task in
    grid)
        model=${1:?grid MODEL GLOBAL_BATCH [STOP_AFTER]}
        batch=${2:?grid MODEL GLOBAL_BATCH [STOP_AFTER]}
        stop=8m
        shift 2
        if [ $# -gt 0 ] && [ "$1" != "--" ]; then stop=$1; shift; fi
        [ "${1:-}" = "--" ] && shift
        folder=$GRIDS/$NODE/$model
        resume=()
        [ -f "$folder/node.json" ] && resume=(--resume)
        timeout --signal=TERM --kill-after=20 "$(left)" "$PY" bench/record_grid.py \
            --model "$model" --seq-len 2048 --global-batch "$batch" --out "$folder" \
            --trials-dir "$ROOT/trials" --stop-after "$stop" "${resume[@]}" "$@" \
            2>&1 | tee "$OUT/grid.log"
        status=${PIPESTATUS[0]}
        tar czf "$OUT/grid.tar.gz" -C "$GRIDS" "$NODE/$model"
        ;;
    run)
        model=${1:?run MODEL GLOBAL_BATCH BUDGET}
        batch=${2:?run MODEL GLOBAL_BATCH BUDGET}
        budget=${3:?run MODEL GLOBAL_BATCH BUDGET}
        shift 3
        [ "${1:-}" = "--" ] && shift
        mkdir -p "$RUNS"
        timeout --signal=TERM --kill-after=20 "$(left)" "$PY" -m autotune.cli run \
            --model "$model" --seq-len 2048 --global-batch "$batch" --budget "$budget" \
            --storage "sqlite:///$RUNS/$model.db" --trials-dir "$RUNS/trials-$model" --json "$@" \
            >"$OUT/run.json" 2>"$OUT/run.log"
        status=$?
        tail -n 40 "$OUT/run.log"
        # the study and every probe's result.json and command (logs stay behind)
        (cd "$RUNS" && find "$model.db" "trials-$model" \( -name '*.db' -o -name result.json \
            -o -name config.json -o -name cmd.txt \) -print0 2>/dev/null |
            tar czf "$OUT/run.tar.gz" --null -T -)
        ;;
    overhead)
        model=${1:-qwen2.5-1.5b}
        timeout --signal=TERM --kill-after=20 "$(left)" "$PY" bench/probe_overhead.py \
            --model "$model" --engine single --seq-len 2048 2>&1 | tee "$OUT/overhead.txt"
        status=${PIPESTATUS[0]}
        ;;
    noise)
        stop=5m
        if [ $# -gt 0 ] && [ "$1" != "--" ]; then stop=$1; shift; fi
        [ "${1:-}" = "--" ] && shift
        query=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw
        nvidia-smi --query-gpu=$query --format=csv >"$OUT/gpu.csv" 2>&1
        timeout --signal=TERM --kill-after=20 "$(left)" "$PY" bench/repeat_noise.py \
            --stop-after "$stop" --out "$RUNS/repeat-noise" "$@" 2>&1 | tee "$OUT/noise.log"
        status=${PIPESTATUS[0]}
        nvidia-smi --query-gpu=$query --format=csv,noheader >>"$OUT/gpu.csv" 2>&1
        tar czf "$OUT/noise.tar.gz" -C "$RUNS" repeat-noise
        ;;
    *)
        echo "unknown task $task: use grid, run, overhead or noise" >&2
        exit 2
        ;;
esac
pack_ext
echo "gpu_call $task: exit $status after $((SECONDS - started)) s on $NODE"
exit "$status"
