#!/usr/bin/env bash
# On the GPU machine (device tool): build the op, run the GPU tests, then the benchmark.
# Usage: bash scripts/gpu_check.sh [tests|bench|all] [extra bench args...]; logs go to $OUT (or ./gpu_out).
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
start=$(date +%s)
python3 -c "from op_builder import CometBuilder; CometBuilder().load(verbose=False); print('ds_comet op ready')" \
    > "$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
echo "op build: $(( $(date +%s) - start )) s"
if [ "$what" = tests ] || [ "$what" = all ]; then
    # test_gate.py runs its bitwise comparisons with stock's gate on CUDA as well when a GPU is there.
    timeout 420 python3 -m pytest tests/test_fused_gpu.py tests/test_gate.py -x -q -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout 420 torchrun --nproc_per_node "$(python3 -c 'import torch; print(torch.cuda.device_count())')" \
        --master_port 29631 -m ds_comet.bench --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "^\[" | tail -30
fi
