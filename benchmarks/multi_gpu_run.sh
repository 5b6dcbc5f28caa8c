#!/usr/bin/env bash
# Issue 23 on a machine with 2+ GPUs (nvidia-h200-x2 / -x4 / -x8), in two device calls (see Budget):
#   correctness over NCCL, then tensor and pipeline parallelism against their peers.
# Budget: check ~60 s, tp (1.3B, 3 stepfx systems + DTensor) ~250 s, pp (6.6B, 8 micro-batches) ~250 s: over
# one call's 600 s in all, so MODES="check tp" in one call and MODES=pp in the next.
# MODES/SIZE_TP/SIZE_PP override; results in $OUT/multi_gpu.jsonl, logs per mode.
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
start=$(date +%s)
nvidia-smi -q -d POWER > $OUT/power_before.txt 2>&1
run() {  # mode, limit, extra args
  timeout $2 torchrun --standalone --nproc_per_node $N benchmarks/multi_gpu.py --mode $1 --out $OUT "${@:3}" > $OUT/multi_gpu_$1.log 2>&1
  echo "$1 rc=$? at $(( $(date +%s) - start ))s"
}
for mode in ${MODES:-check tp pp}; do
  case $mode in
    check) run check 120 ;;
    tp) run tp 280 --size ${SIZE_TP:-1.3B} --steps 10 ;;
    pp) run pp 260 --size ${SIZE_PP:-6.6B} --micro 8 --steps 5 ;;
  esac
done
nvidia-smi -q -d POWER > $OUT/power_after.txt 2>&1
grep -E "Power Draw|Current Power Limit" $OUT/power_after.txt | sort | uniq -c | head -6
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ.get("OUT", "/tmp/out"), "multi_gpu.jsonl")):
    r = json.loads(line)
    for k in ("command", "date", "torch", "gpu", "timing"):
        r.pop(k, None)
    print(json.dumps(r)[:600])
PY
grep -ihE "error|Traceback" $OUT/multi_gpu_*.log | grep -v "^{" | head -8
