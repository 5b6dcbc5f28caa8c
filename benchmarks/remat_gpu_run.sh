#!/usr/bin/env bash
# One device call for issue 18's activation-checkpointing benchmark: the epilogue test on CUDA, then
# benchmarks/remat.py with the compute bound measured first and the peers in the same run, at a
# micro-batch that does not fit without recomputation on this GPU (48 on an H200's 141 GB, 24 on an
# H100's 80 GB: 91 GiB without it), then stepfx at budget 0 again under the profiler.
#   bash benchmarks/remat_gpu_run.sh          (on the device machine, from the repository root; $OUT set)
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv > "$OUT/gpus.txt" 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/passes/test_fuse_linear_gelu.py -k epilogue > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/timeline.txt"
GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
if [ "$GIB" -gt 100 ]; then B=${BATCH:-48}; PLAN=${PLAN:-90}; else B=${BATCH:-24}; PLAN=${PLAN:-60}; fi
timeout "${REMAT_S:-450}" python3 benchmarks/remat.py --out "$OUT" --batch "$B" --warmup 2 --steps 8 \
  --systems "${SYSTEMS:-bound,stepfx-0,stepfx-gib$PLAN,eager-ckpt,compile-0,stepfx}" > "$OUT/remat.log" 2>&1
echo "remat rc=$? batch $B" >> "$OUT/timeline.txt"
if [ -n "${PROFILE:-1}" ]; then
  timeout "${PROFILE_S:-110}" python3 benchmarks/remat.py --out "$OUT/profile" --batch "$B" --warmup 2 --steps 2 \
    --profile --systems stepfx-0 > "$OUT/profile.log" 2>&1
  echo "profile rc=$?" >> "$OUT/timeline.txt"
fi
cat "$OUT/timeline.txt"; tail -n 3 "$OUT/tests.log"
python3 - "$OUT" <<'PY'
import json, sys
for line in open(sys.argv[1] + "/remat.jsonl"):
    r = json.loads(line)
    print({k: r.get(k) for k in ("system", "batch", "tokens_per_s", "mfu_useful", "mfu_counted", "of_compute_bound",
                                 "of_measured_bound", "bound_mfu", "bound_step_ms", "parts_ms", "peak_alloc_gib", "final_loss", "error")})
PY
