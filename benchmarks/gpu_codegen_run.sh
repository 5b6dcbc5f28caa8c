#!/usr/bin/env bash
# Issue 5's GPU run on a 2-GPU machine, in one call (device time is scarce):
# GPU 0: the 1.3B single-GPU step (eager, compile, stepfx, stepfx+codegen),
#        then the single-GPU CUDA tests (tests/gpu -m gpu);
# GPU 1: the kernel tests compiled for real (tests/codegen), then the kernel
#        benchmarks (stepfx vs eager, torch.compile, fused AdamW);
# then, on both GPUs, ZeRO 0-3 with codegen over NCCL.
# Each benchmark's peers run in the same process as stepfx. Logs and JSON
# lines go to $OUT. Knobs (environment): SYSTEMS (single_gpu.py's list),
# PROFILE=1 (profile each system's steps too), CODEGEN_TESTS (test paths),
# MULTIGPU=0 (skip the 2-GPU tests), SINGLE_S / KERNELS_S / TOTAL_S (limits).
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
(
  CUDA_VISIBLE_DEVICES=0 timeout "${SINGLE_S:-300}" python3 benchmarks/single_gpu.py --systems "${SYSTEMS:-eager,stepfx-codegen,compile,stepfx}" --warmup 5 --steps 20 ${PROFILE:+--profile} --out "$OUT" > "$OUT/single_gpu.log" 2>&1
  echo "single_gpu rc=$? at $(( $(date +%s) - start ))s" >> "$OUT/timeline.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 180 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu > "$OUT/gpu_tests.log" 2>&1
  echo "gpu_tests rc=$? at $(( $(date +%s) - start ))s" >> "$OUT/timeline.txt"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -p no:cacheprovider ${CODEGEN_TESTS:-tests/codegen} > "$OUT/codegen_tests.log" 2>&1
  echo "codegen_tests rc=$? at $(( $(date +%s) - start ))s" >> "$OUT/timeline.txt"
  CUDA_VISIBLE_DEVICES=1 timeout "${KERNELS_S:-280}" python3 benchmarks/kernels.py --out "$OUT" > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$? at $(( $(date +%s) - start ))s" >> "$OUT/timeline.txt"
) &
wait
left=$(( ${TOTAL_S:-540} - ($(date +%s) - start) ))
if [ "${MULTIGPU:-1}" = 1 ] && [ "$left" -gt 40 ]; then
  timeout "$left" python3 -m pytest -q -s -p no:cacheprovider -m multigpu tests/gpu -k codegen > "$OUT/multigpu_codegen_tests.log" 2>&1
  echo "multigpu codegen rc=$? at $(( $(date +%s) - start ))s" >> "$OUT/timeline.txt"
fi
cat "$OUT/timeline.txt"
for f in "$OUT"/*.log; do echo "== $f"; tail -n 5 "$f"; done
