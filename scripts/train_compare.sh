#!/usr/bin/env bash
# Stock DeepSpeed MoE against the comet backend, training examples/train_moe.py on NRANKS (default 2) GPUs.
#
#   (a) 200 steps, ZeRO-2, stock then comet (deepspeed launcher, same seed and data)
#       -> loss curves ($OUT/loss_curves.png) and a table: tokens/s, ratio, peak memory, losses, and the
#       MoE layers', the optimizer step's and the rest's ms a step (the example's --step-shares)
#   (b) comet, ZeRO-1: 60 steps saving a checkpoint at step 30, then a run resumed from it, whose
#       steps 31-60 must reproduce the uninterrupted run's (losses and learning rates)
#   (c) comet, ZeRO-2, 30 steps under a bare mpirun; its losses must follow (a)'s comet run (so
#       PARTS with c needs a)
#   (e) only when PARTS has e: AB_ROUNDS (default 2) interleaved rounds of the arms in AB_ARMS
#       (stock first; default "stock comet graph", graph = comet with "cuda_graph_gate": true),
#       even rounds in reverse order, STEPS steps each without evaluation -> $OUT/rounds.{md,json}:
#       each round's tokens/s over that round's stock run, and peak memory. A job's throughput
#       drifts a few % from run to run, which (a)'s single pair cannot tell from a difference.
#       The default budget is then 560 s.
#
# Usage (repository root): bash scripts/train_compare.sh
# Everything lands in $OUT (default /tmp/train_compare_out): per sub-run NAME.cmd, NAME.log and
# monitor/NAME/ (its metrics: DeepSpeed's csv_monitor files, through the example's --monitor-dir),
# summary.{txt,md,json}, loss_curves.png and status.txt.
# Each sub-run has a time limit, and all of them together stay inside BUDGET_S seconds from the
# start (a sub-run that would not fit is skipped and counted as a failure). A failed sub-run is
# reported with the tail of its log and the script goes on; it exits 1 if anything failed.
#
# TRAIN_COMPARE_CPU=1 runs the same sequence on CPU (gloo, the example's small default model,
# a few steps) to exercise the script, the checks and the plot on a machine without GPUs.
# TRAIN_COMPARE_SHARED_GPU=1 puts every rank on GPU 0 over gloo (scripts/shared_gpu_ranks.sh) for a
# one-GPU machine, and skips (c). Losses, resume and peak memory per rank are checked as with a GPU
# a rank; tokens/s are not comparable (the GPU time-slices between the ranks; gloo stages through
# the host). NRANKS (default 2) is the number of ranks, and the expert-parallel size: the example
# puts 4 experts on each rank.
# PRESET picks the example's GPU preset (gpu, the default, or gpu-fine); PARTS (default abc) which
# of (a), (b), (c), (e) run ((a) with its summary (d)); GRAD_ACCUM overrides the configs' gradient accumulation
# and MICRO_BATCH their micro-batch size.
# Other knobs: STEPS, RESUME_STEPS, RESUME_AT, MPI_STEPS, RUN_LIMIT_S,
# BUDGET_S, CKPT_DIR, LOSS_MAX_DIFF_TOL, LOSS_TAIL_DIFF_TOL, RESUME_FIRST_TOL, RESUME_TOL, MPI_DIFF_TOL.
# MPI_DIFF_TOL is 0.1: two launches of the same comet run on 2 x H200 differed by up to 0.06 (step 19), as
# much as stock and comet differ (attention's backward and NCCL reductions are not bit-reproducible).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/train_compare_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CPU=${TRAIN_COMPARE_CPU:-0}
SHARED=${TRAIN_COMPARE_SHARED_GPU:-0}
NRANKS=${NRANKS:-2}
[[ $NRANKS =~ ^[1-9][0-9]*$ ]] || { echo "NRANKS must be a positive integer, got '$NRANKS'" >&2; exit 2; }
RANKS="$NRANKS ranks"
if [ "$SHARED" = 1 ]; then RANKS+=" on one GPU"; fi
START_S=$(date +%s)

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
EXPORTS=(PYTHONPATH PATH PYTHONUNBUFFERED NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS
         TORCH_EXTENSIONS_DIR)

if [ "$CPU" = 1 ]; then
    # NRANKS gloo ranks on CPU, the example's small default model, bf16 as on GPU (the same configs).
    export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
    EXPORTS+=(CUDA_VISIBLE_DEVICES DS_ACCELERATOR OMP_NUM_THREADS)
    MODEL=(--seed 1234 --log-interval 4 --timing-warmup 2 --log-level info)
    STEPS=${STEPS:-24} RESUME_STEPS=${RESUME_STEPS:-12} RESUME_AT=${RESUME_AT:-6} MPI_STEPS=${MPI_STEPS:-8}
    EVAL_BATCHES=1 BUDGET_S=${BUDGET_S:-1500} MIN_STEP_S=60
else
    MODEL=(--preset "${PRESET:-gpu}" --seed 1234 --log-level info)  # info: the logs say which pipeline ran
    STEPS=${STEPS:-200} RESUME_STEPS=${RESUME_STEPS:-60} RESUME_AT=${RESUME_AT:-30} MPI_STEPS=${MPI_STEPS:-30}
    # Part (e)'s six more runs need about two more minutes.
    EVAL_BATCHES=4 BUDGET_S=${BUDGET_S:-$([[ ${PARTS:-abc} == *e* ]] && echo 560 || echo 440)} MIN_STEP_S=30
fi
RESERVE_S=20  # kept back for the summary at the end
# Each training run's own limit; the ZeRO-1 runs (fewer steps) get three quarters of it. Ranks that
# share one GPU time-slice it, so more of them need more.
RUN_LIMIT_S=${RUN_LIMIT_S:-200}
[[ $RUN_LIMIT_S =~ ^[1-9][0-9]*$ ]] || { echo "RUN_LIMIT_S must be a positive integer, got '$RUN_LIMIT_S'" >&2; exit 2; }
# (b)'s checkpoints go to a directory of the script's own, made under CKPT_DIR (default $TMPDIR or /tmp)
# and removed after (b): a directory the user named is never removed.
CKPT_DIR=${CKPT_DIR:-${TMPDIR:-/tmp}}
LOSS_MAX_DIFF_TOL=${LOSS_MAX_DIFF_TOL:-0.3} LOSS_TAIL_DIFF_TOL=${LOSS_TAIL_DIFF_TOL:-0.05}
RESUME_FIRST_TOL=${RESUME_FIRST_TOL:-0.005} RESUME_TOL=${RESUME_TOL:-0.02} MPI_DIFF_TOL=${MPI_DIFF_TOL:-0.1}
CONFIGS=$REPO/configs
MONITOR=$OUT/monitor  # one csv_monitor directory per sub-run
FAILURES=()

elapsed() { echo $(( $(date +%s) - START_S )); }
note() { echo "[$(printf '%4d' "$(elapsed)") s] $*"; }

# run_step NAME LIMIT_S COMMAND...: run with a time limit (cut to what the budget has left), its
# output in $OUT/NAME.log; returns the command's status and records a failure. Metrics in
# $MONITOR/NAME left by an earlier invocation are removed first, so that a skipped or failed run
# cannot be summarised from them (the csv_monitor appends to existing files).
run_step() {
    local name=$1 limit=$2 left rc=0 began took why
    shift 2
    rm -rf "${MONITOR:?}/$name"
    left=$(( BUDGET_S - $(elapsed) - RESERVE_S ))
    if (( left < MIN_STEP_S )); then
        FAILURES+=("$name: skipped, $(elapsed) s of the $BUDGET_S s budget used")
        note "SKIP $name: out of time"
        return 1
    fi
    (( limit > left )) && limit=$left
    printf '%q ' "$@" > "$OUT/$name.cmd"
    echo >> "$OUT/$name.cmd"
    note "RUN  $name (limit $limit s): $*"
    began=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    took=$(( $(date +%s) - began ))
    if (( rc == 0 )); then
        note "OK   $name ($took s)"
        {
            grep -E '^(final loss|throughput|peak memory|eval loss|resumed|ds_comet op|shm comm op)' "$OUT/$name.log"
            grep -oE 'ds_comet: .* runs the (fused|reference) pipeline.*' "$OUT/$name.log" | sort -u
        } | sed 's/^/         /' || true
        return 0
    fi
    if (( rc == 124 || rc == 137 )); then why="timed out after $limit s"; else why="exit status $rc"; fi
    FAILURES+=("$name: $why (log: $OUT/$name.log)")
    note "FAIL $name: $why; its last lines:"
    tail -n 30 "$OUT/$name.log" | sed 's/^/         /'
    return "$rc"
}

# train NAME PORT CONFIG ARGS...: the example on NRANKS ranks under the deepspeed launcher (all on GPU 0
# over gloo when SHARED).
train() {
    local name=$1 port=$2 config=$3 limit=$4
    shift 4
    local example=(examples/train_moe.py --deepspeed_config "$config" "${MODEL[@]}" --monitor-dir "$MONITOR/$name"
                   "$@")
    if [ "$SHARED" = 1 ]; then
        run_step "$name" "$limit" bash scripts/shared_gpu_ranks.sh "$NRANKS" "$port" python3 "${example[@]}" --dist-backend gloo
    else
        run_step "$name" "$limit" deepspeed --num_gpus "$NRANKS" --master_port "$port" "${example[@]}"
    fi
}

note "train_compare: OUT=$OUT, budget $BUDGET_S s, $([ "$CPU" = 1 ] && echo "CPU mode" || echo GPU)$(
    [ "$SHARED" = 1 ] && echo ", all $NRANKS ranks on GPU 0 (tokens/s not comparable)")"
{
    command -v nvidia-smi > /dev/null && nvidia-smi -L
    python3 - << 'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "deepspeed", "triton", "mpi4py", "matplotlib"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "not importable:", type(error).__name__)
import torch
print("cuda devices", torch.cuda.device_count())
EOF
    command -v mpirun > /dev/null && mpirun --version 2>&1 | head -n 1
    git -C "$REPO" rev-parse HEAD 2> /dev/null || true
} > "$OUT/environment.txt" 2>&1 || true
sed 's/^/         /' "$OUT/environment.txt"

# build_op NAME EXTENSION LIMIT_S PYTHON: JIT-build an op into $TORCH_EXTENSIONS_DIR before the runs, so
# that no run spends its time limit on it. A build this script killed leaves its lock file behind,
# on which every later load would wait forever: remove it.
build_op() {
    local name=$1 extension=$2 limit=$3 code=$4
    run_step "$name" "$limit" python3 -c "$code" && return 0
    rm -f "$TORCH_EXTENSIONS_DIR/$extension/lock"
    return 1
}

# override [--prefix=P] PYTHON_STATEMENT VAR...: each VAR's config, with the statement applied to it
# (as c), written to $OUT/configs under its own name (after P); VAR then names the copy. The config
# is read as DeepSpeed reads it (HJSON, a key given twice an error) and written as JSON.
override() {
    local prefix="" statement var src dst
    if [[ $1 == --prefix=* ]]; then prefix=${1#--prefix=}; shift; fi
    statement=$1
    shift
    mkdir -p "$OUT/configs"
    for var in "$@"; do
        src=${!var} dst="$OUT/configs/$prefix$(basename "${!var}")"
        python3 -c "import hjson, json, sys
def unique(pairs):
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        sys.exit(f'{sys.argv[1]}: keys given twice: {twice}')
    return dict(pairs)
c = hjson.load(open(sys.argv[1]), object_pairs_hook=unique); $statement
json.dump(c, open(sys.argv[2], 'w'), indent=2)" "$src" "$dst"
        printf -v "$var" '%s' "$dst"
    done
}

PARTS=${PARTS:-abc}
[[ $PARTS != *c* || $PARTS == *a* ]] || { echo "PARTS=$PARTS: (c) compares with (a)'s comet run; add a" >&2; exit 2; }
AB_ROUNDS=${AB_ROUNDS:-2} AB_ARMS=${AB_ARMS:-stock comet graph}
[[ $AB_ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "AB_ROUNDS must be a positive integer, got '$AB_ROUNDS'" >&2; exit 2; }
read -ra ARMS <<< "$AB_ARMS"
# Every round's ratios are to its stock run, which therefore comes first in AB_ARMS.
[[ ${ARMS[0]:-} == stock ]] || { echo "AB_ARMS must start with stock, got '$AB_ARMS'" >&2; exit 2; }
for arm in "${ARMS[@]}"; do
    [[ $arm =~ ^(stock|comet|graph)$ ]] || { echo "AB_ARMS takes stock, comet and graph, got '$arm'" >&2; exit 2; }
done
(( $(printf '%s\n' "${ARMS[@]}" | sort -u | wc -l) == ${#ARMS[@]} )) || {
    echo "AB_ARMS names an arm twice: '$AB_ARMS'" >&2; exit 2; }

COMET_ZERO2=$CONFIGS/gpu_zero2_comet.json COMET_ZERO1=$CONFIGS/gpu_zero1_comet.json
STOCK_ZERO2=$CONFIGS/gpu_zero2_deepspeed.json
if [ -n "${GRAD_ACCUM:-}" ]; then
    [[ $GRAD_ACCUM =~ ^[1-9][0-9]*$ ]] || { echo "GRAD_ACCUM must be a positive integer, got '$GRAD_ACCUM'" >&2; exit 2; }
    # Micro-batches per optimizer step: DeepSpeed's step costs per parameter tensor, not per token,
    # so accumulating amortises it over more tokens, as large-batch MoE training does.
    note "gradient_accumulation_steps $GRAD_ACCUM (configs in $OUT/configs)"
    override "c['gradient_accumulation_steps'] = $GRAD_ACCUM" COMET_ZERO2 COMET_ZERO1 STOCK_ZERO2
fi
if [ -n "${MICRO_BATCH:-}" ]; then
    [[ $MICRO_BATCH =~ ^[1-9][0-9]*$ ]] || { echo "MICRO_BATCH must be a positive integer, got '$MICRO_BATCH'" >&2; exit 2; }
    # Sequences per rank and micro-batch: with more ranks sharing one GPU, a smaller one keeps the
    # job's tokens a step, and its time, where fewer ranks had them.
    note "train_micro_batch_size_per_gpu $MICRO_BATCH (configs in $OUT/configs)"
    override "c['train_micro_batch_size_per_gpu'] = $MICRO_BATCH" COMET_ZERO2 COMET_ZERO1 STOCK_ZERO2
fi
if [ "$CPU" = 1 ]; then
    # DeepSpeed's shared-memory comm op, which its CPU accelerator builds at init (minutes on 2 cores).
    build_op build_shm_op deepspeed_shm_comm 600 "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False); print('shm comm op ready')" || true
else
    # The comet op: the comet runs' MoE layers run the fused pipeline (training and evaluation).
    if ! build_op build_op ds_comet_ops 240 \
        "from op_builder import CometBuilder; CometBuilder().load(verbose=False); print('ds_comet op ready')"; then
        # Without the op, "auto" would try (and fail) to build it again in every comet run: run the
        # comet configs on the reference pipeline instead, which the logs and the table then show.
        note "the comet runs use \"overlap\": \"none\" (configs in $OUT/configs)"
        override "c['moe']['overlap'] = 'none'" COMET_ZERO2 COMET_ZERO1
    fi
fi

# --- (a) stock vs comet, ZeRO-2, same seed and data.
if [[ $PARTS != *a* ]]; then
    note "SKIP a_stock_zero2, a_comet_zero2 and their summary: PARTS=$PARTS"
    # An earlier invocation's (a) must not pass for this one's.
    rm -rf "$OUT"/summary.{txt,md,json} "$OUT/loss_curves.png" "${MONITOR:?}"/a_*
else
    train a_stock_zero2 29571 "$STOCK_ZERO2" "$RUN_LIMIT_S" --steps "$STEPS" --eval-batches "$EVAL_BATCHES" --step-shares || true
    train a_comet_zero2 29572 "$COMET_ZERO2" "$RUN_LIMIT_S" --steps "$STEPS" --eval-batches "$EVAL_BATCHES" --step-shares || true

    # --- (d) the picture and the table, right away so that they exist whatever happens next.
    note "RUN  summary: scripts/plot_losses.py"
    rc=0
    timeout 120 python3 scripts/plot_losses.py plot --out "$OUT/loss_curves.png" --json "$OUT/summary.json" \
        --markdown "$OUT/summary.md" --max-diff-tol "$LOSS_MAX_DIFF_TOL" --tail-diff-tol "$LOSS_TAIL_DIFF_TOL" \
        --title "train_moe.py, $RANKS, ZeRO-2, $STEPS steps: stock DeepSpeed MoE vs comet" \
        "stock=$MONITOR/a_stock_zero2" "comet=$MONITOR/a_comet_zero2" > "$OUT/summary.txt" 2>&1 || rc=$?
    sed 's/^/         /' "$OUT/summary.txt"
    (( rc == 0 )) || FAILURES+=("summary: plot_losses.py exit status $rc (see $OUT/summary.txt)")
fi

# --- (b) ZeRO-1 checkpoint at RESUME_AT, resumed run against the uninterrupted one.
mkdir -p "$CKPT_DIR"
CKPT_RUN_DIR=$(mktemp -d "$CKPT_DIR/train_compare_ckpt.XXXXXX")
[[ $PARTS == *b* ]] || note "SKIP b_zero1_full, b_zero1_resumed: PARTS=$PARTS"
if [[ $PARTS == *b* ]] && train b_zero1_full 29573 "$COMET_ZERO1" $((RUN_LIMIT_S * 3 / 4)) --steps "$RESUME_STEPS" --eval-batches 0 \
        --save-dir "$CKPT_RUN_DIR" --save-at "$RESUME_AT" --no-final-save; then
    if train b_zero1_resumed 29574 "$COMET_ZERO1" $((RUN_LIMIT_S * 3 / 4)) --steps "$RESUME_STEPS" --eval-batches 0 \
            --save-dir "$CKPT_RUN_DIR" --resume --no-final-save; then
        rc=0
        python3 scripts/plot_losses.py resume-check --full "$MONITOR/b_zero1_full" \
            --resumed "$MONITOR/b_zero1_resumed" --from-step "$RESUME_AT" --first-tol "$RESUME_FIRST_TOL" \
            --tol "$RESUME_TOL" > "$OUT/b_resume_check.txt" 2>&1 || rc=$?
        sed 's/^/         /' "$OUT/b_resume_check.txt"
        (( rc == 0 )) || FAILURES+=("resume check: the resumed run differs (see $OUT/b_resume_check.txt)")
    fi
fi
rm -rf "$CKPT_RUN_DIR"

# --- (c) a bare mpirun: ranks from the MPI launcher's environment, same losses as (a)'s comet run.
if [[ $PARTS != *c* ]]; then
    note "SKIP c_mpirun_zero2: PARTS=$PARTS"
elif [ "$SHARED" = 1 ]; then
    note "SKIP c_mpirun_zero2: every rank on one GPU"
elif command -v mpirun > /dev/null; then
    MPIRUN=(mpirun -np "$NRANKS")
    if mpirun --version 2>&1 | grep -qiE 'open mpi|openrte|open-rte'; then
        [ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
        MPIRUN+=(--bind-to none -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29575)
        for var in "${EXPORTS[@]}"; do MPIRUN+=(-x "$var"); done
    else  # MPICH / Hydra passes the environment on by itself
        MPIRUN+=(-genv MASTER_ADDR 127.0.0.1 -genv MASTER_PORT 29575)
    fi
    if run_step c_mpirun_zero2 120 "${MPIRUN[@]}" python3 examples/train_moe.py --deepspeed_config "$COMET_ZERO2" \
            "${MODEL[@]}" --steps "$MPI_STEPS" --eval-batches 1 --monitor-dir "$MONITOR/c_mpirun_zero2"; then
        rc=0
        python3 scripts/plot_losses.py plot --max-diff-tol "$MPI_DIFF_TOL" \
            "deepspeed_launcher=$MONITOR/a_comet_zero2" "mpirun=$MONITOR/c_mpirun_zero2" \
            > "$OUT/c_mpirun_vs_launcher.txt" 2>&1 || rc=$?
        sed 's/^/         /' "$OUT/c_mpirun_vs_launcher.txt"
        (( rc == 0 )) || FAILURES+=("mpirun check: exit status $rc comparing with (a)'s comet run (see $OUT/c_mpirun_vs_launcher.txt)")
    fi
else
    FAILURES+=("c_mpirun_zero2: mpirun is not on PATH")
fi

# --- (e) interleaved rounds: tokens/s ratios that the host's drift between runs does not decide.
if [[ $PARTS == *e* ]]; then
    COMET_GRAPH=$COMET_ZERO2
    override --prefix=graph_gate_ "c['moe']['cuda_graph_gate'] = True" COMET_GRAPH
    ROUND_RUNS=()
    port=29580
    for round in $(seq 1 "$AB_ROUNDS"); do
        order=("${ARMS[@]}")
        # Even rounds run the arms in reverse, so that no arm always runs in the same place.
        (( round % 2 )) || order=($(printf '%s\n' "${ARMS[@]}" | tac))
        for arm in "${order[@]}"; do
            case $arm in
                stock) arm_config=$STOCK_ZERO2 ;;
                comet) arm_config=$COMET_ZERO2 ;;
                graph) arm_config=$COMET_GRAPH ;;
            esac
            port=$((port + 1))
            train "e_${arm}_r$round" "$port" "$arm_config" "$RUN_LIMIT_S" --steps "$STEPS" --eval-batches 0 --step-shares \
                || true
            ROUND_RUNS+=("$arm/$round=$MONITOR/e_${arm}_r$round")
        done
    done
    note "RUN  rounds summary: scripts/plot_losses.py rounds"
    rc=0
    python3 scripts/plot_losses.py rounds --json "$OUT/rounds.json" --markdown "$OUT/rounds.md" \
        --title "train_moe.py, $RANKS, ZeRO-2, $STEPS steps, $AB_ROUNDS interleaved rounds" "${ROUND_RUNS[@]}" \
        > "$OUT/rounds.txt" 2>&1 || rc=$?
    sed 's/^/         /' "$OUT/rounds.txt"
    (( rc == 0 )) || FAILURES+=("rounds: plot_losses.py exit status $rc (see $OUT/rounds.txt)")
fi

# --- Status.
{
    echo "train_compare finished after $(elapsed) s"
    if (( ${#FAILURES[@]} )); then
        echo "${#FAILURES[@]} failure(s):"
        printf '  - %s\n' "${FAILURES[@]}"
    else
        echo "all sub-runs and checks passed"
    fi
} | tee "$OUT/status.txt"
(( ${#FAILURES[@]} == 0 ))
