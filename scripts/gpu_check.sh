#!/usr/bin/env bash
# On the GPU machine (device tool): build the op, run the GPU tests, then the benchmark.
# Usage: bash scripts/gpu_check.sh [tests|bench|all|sweep|shared|soak|gemm|internode|deepgemm] [extra bench args...]; logs go to $OUT (or ./gpu_out).
# shared: the fused tests with SHARED_RANKS (2) ranks on the GPU (DS_COMET_TEST_RANKS_PER_GPU), for a
# one-GPU machine: the multi-rank paths, time-sliced (results only; about 3 minutes on one H200 at
# 2 ranks; at 4, 17 tests took about 4 minutes, so run the suite in parts with DS_COMET_TEST_SHARD=i/n),
# stopped after SHARED_SECONDS (420).
# sweep: the fused layer alone on the default shapes (idle-device, back-to-back and device-alone times,
# graphed gate), and shape 2 at 2, 4 and the rule's column chunks.
# soak: SOAK_CALLS (1000) random fused calls, each against float64 and the reference pipeline, at
# EP=SOAK_EP (2) with SOAK_RANKS_PER_GPU (the EP size on one GPU) ranks a GPU, stopping at the first
# case past SOAK_SECONDS (420); writes $out/soak/soak.json and the progress lines to $out/soak.log.
# gemm: each GEMM phase alone against torch._grouped_mm (python -m ds_comet.bench.gemm).
# internode: the exchange across declared nodes (one GPU a node), each chunk count against the whole
# exchange (python -m ds_comet.bench.internode); needs two GPUs or more.
# deepgemm: builds DeepGEMM from DEEPGEMM_SRC into /tmp/site (scripts/build_deepgemm.sh), then times its
# grouped GEMMs beside torch's and measures their error by K (python -m ds_comet.bench.library_fp8
# --deepgemm, with and without --accumulation); needs no ds_comet op, so builds none.
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
start=$(date +%s)
if [ "$what" = deepgemm ]; then
    timeout 420 bash scripts/build_deepgemm.sh "${DEEPGEMM_SRC:?set DEEPGEMM_SRC to a DeepGEMM source tree}" /tmp/site \
        > "$out/deepgemm_build.log" 2>&1 || { tail -60 "$out/deepgemm_build.log"; exit 1; }
    echo "DeepGEMM build: $(( $(date +%s) - start )) s"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    timeout 300 python3 -m ds_comet.bench.library_fp8 --deepgemm --out "$out/library_fp8" "$@" 2>&1 \
        | tee "$out/library_fp8.log" | tail -12
    timed=${PIPESTATUS[0]}
    timeout 240 python3 -m ds_comet.bench.library_fp8 --deepgemm --accumulation --out "$out/library_fp8" 2>&1 \
        | tee "$out/accumulation.log" | tail -16
    measured=${PIPESTATUS[0]}
    [ "$timed" = 0 ] && [ "$measured" = 0 ]; exit $?
fi
python3 -c "from ds_comet.kernels.ops import load_op; load_op(); print('ds_comet op ready')" \
    > "$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
echo "op build: $(( $(date +%s) - start )) s"
if [ "$what" = tests ] || [ "$what" = all ]; then
    # tests/gpu needs a GPU; tests/cpu/test_gate.py runs its bitwise comparisons with stock's gate on CUDA
    # as well when a GPU is there, and test_compile.py compiles the layer (inductor on the GPU).
    timeout 480 python3 -m pytest tests/gpu tests/cpu/test_gate.py tests/cpu/test_compile.py \
        -x -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout 420 torchrun --nproc_per_node "$(python3 -c 'import torch; print(torch.cuda.device_count())')" \
        --master_port 29631 -m ds_comet.bench --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^\[" | tail -30
fi
if [ "$what" = shared ]; then
    ranks=${SHARED_RANKS:-2}
    DS_COMET_TEST_RANKS_PER_GPU=$ranks DS_COMET_TEST_WORLD_SIZE=$ranks timeout "${SHARED_SECONDS:-420}" python3 -m pytest \
        tests/gpu/test_fused.py tests/gpu/test_autoep.py tests/cpu/test_compile.py -k "fused" -x -q -p no:cacheprovider \
        > "$out/gpu_tests_shared.log" 2>&1
    tail -20 "$out/gpu_tests_shared.log"
fi
if [ "$what" = sweep ]; then
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    timeout 300 torchrun --nproc_per_node "$gpus" --master_port 29632 -m ds_comet.bench.sweep --gate-ops graph \
        --shape H4096-F14336-E8-k2-T8192 --shape H7168-F2048-E32-k8-T4096 --out "$out/sweep" 2>&1 \
        | tee "$out/sweep.log" | grep -v "^\[" | tail -12
    timeout 300 torchrun --nproc_per_node "$gpus" --master_port 29633 -m ds_comet.bench.sweep --gate-ops graph \
        --shape H2048-F1408-E64-k4-T8192 --n-chunks auto,2,4 --out "$out/sweep-chunks" 2>&1 \
        | tee "$out/sweep-chunks.log" | grep -v "^\[" | tail -12
fi
if [ "$what" = soak ]; then
    ep=${SOAK_EP:-2}
    # The ranks stop together, with a full report, at the first case past SOAK_SECONDS: keep it a
    # minute or two under the device call's limit, which also pays for the op build above.
    timeout 570 python3 -m tests.support.soak --calls "${SOAK_CALLS:-1000}" --world-size "$ep" \
        --ranks-per-gpu "${SOAK_RANKS_PER_GPU:-$ep}" --seed "${SOAK_SEED:-1}" --max-seconds "${SOAK_SECONDS:-420}" \
        --calls-per-case 20 --progress 50 --out "$out/soak" > "$out/soak.log" 2>&1
    grep -v "^\[" "$out/soak.log" | tail -25
fi
if [ "$what" = gemm ]; then
    timeout 400 torchrun --nproc_per_node 1 --master_port 29634 -m ds_comet.bench.gemm --out "$out/gemm" "$@" 2>&1 \
        | grep -v "^\[" | tee "$out/gemm.log" | tail -80
fi
if [ "$what" = internode ]; then
    timeout 400 torchrun --nproc_per_node "$(python3 -c 'import torch; print(torch.cuda.device_count())')" \
        --master_port 29635 -m ds_comet.bench.internode --out "$out/internode" "$@" > "$out/internode.log" 2>&1
    grep -v "^\[" "$out/internode.log" | tail -40
fi
