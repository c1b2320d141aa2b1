#!/usr/bin/env bash
# Start N ranks of COMMAND that all use GPU 0 (RANK, WORLD_SIZE, LOCAL_RANK=0, MASTER_ADDR, MASTER_PORT),
# for a machine with fewer GPUs than ranks; the command must use gloo (examples/train_moe.py
# --dist-backend gloo), since NCCL refuses two ranks on one GPU. The GPU time-slices between them:
# what they compute is checked, their speed is not comparable to one rank a GPU.
#
# Usage: bash scripts/shared_gpu_ranks.sh N PORT COMMAND...
# Exits with the first failing rank's status, after stopping the others; a TERM (a time limit) stops all.
set -uo pipefail
(( $# >= 3 )) && [[ $1 =~ ^[1-9][0-9]*$ && $2 =~ ^[0-9]+$ ]] || {
    echo "usage: $0 N PORT COMMAND... (N ranks, PORT for the rendezvous)" >&2; exit 2; }
ranks=$1 port=$2
shift 2
pids=()
# Each rank leads its own process group, so that stopping it stops whatever it started too.
stop() { local pid; for pid in "${pids[@]}"; do kill -- "-$pid" 2> /dev/null; done; }
trap 'stop; exit 143' TERM INT
for rank in $(seq 0 $((ranks - 1))); do
    RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=0 LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port setsid "$@" &
    pids+=($!)
done
rc=0
for _ in "${pids[@]}"; do
    # A rank that failed leaves its peers waiting on it: stop them, and report the first failure.
    wait -n || { status=$?; (( rc )) || { rc=$status; stop; }; }
done
exit $rc
