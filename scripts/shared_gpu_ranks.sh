#!/usr/bin/env bash
# Start N ranks of COMMAND that all use GPU 0 (RANK, WORLD_SIZE, LOCAL_RANK=0, MASTER_ADDR, MASTER_PORT),
# for a machine with fewer GPUs than ranks; the command must use gloo (examples/train_moe.py
# --dist-backend gloo), since NCCL refuses two ranks on one GPU. The GPU time-slices between them:
# what they compute is checked, their speed is not comparable to one rank a GPU. Not under MPS,
# which runs the ranks' kernels side by side: a rank's waiting kernels can then hold the SMs its
# peer needs, until the wait times out.
#
# Usage: bash scripts/shared_gpu_ranks.sh N PORT COMMAND...
# Exits with the first failing rank's status after stopping the others. TERM, INT or HUP (a time
# limit, say) stops every rank and what it started: TERM first, KILL after GRACE_S (default 10) s.
set -uo pipefail
(( $# >= 3 )) && [[ $1 =~ ^[1-9][0-9]*$ && $2 =~ ^[0-9]+$ ]] || {
    echo "usage: $0 N PORT COMMAND... (N ranks, PORT for the rendezvous)" >&2; exit 2; }
ranks=$1 port=$2 grace=${GRACE_S:-10}
shift 2
pids=()

# Each rank leads its own process group, so that stopping it stops whatever it started too; the
# rank itself is signalled as well, in case it has not reached setsid yet.
signal_all() {
    local pid
    for pid in "${pids[@]}"; do kill "-$1" -- "-$pid" 2> /dev/null; kill "-$1" "$pid" 2> /dev/null; done
}
alive() { local pid; for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2> /dev/null && return 0; done; return 1; }
stop_all() {
    local waited=0
    signal_all TERM
    while alive && (( waited < grace * 10 )); do sleep 0.1; waited=$((waited + 1)); done
    signal_all KILL
}
# A signal while the ranks start is acted on once every started rank is in pids.
pending=0
trap 'pending=143' TERM
trap 'pending=130' INT
trap 'pending=129' HUP
for rank in $(seq 0 $((ranks - 1))); do
    RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=0 LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        setsid "$@" &
    pids+=($!)
    (( pending )) && break
done
trap 'stop_all; exit 143' TERM
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 129' HUP
(( pending )) && { stop_all; exit "$pending"; }
rc=0
for _ in "${pids[@]}"; do
    # A rank that failed leaves its peers waiting on it: stop them, and report the first failure.
    wait -n || { status=$?; (( rc )) || { rc=$status; stop_all; }; }
done
exit $rc
