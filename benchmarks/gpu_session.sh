#!/usr/bin/env bash
# What is waiting for the one-H200 machine, in one call of at most ~560 s
# (device time is scarce: 30 minutes a session, cold starts included).
# Each part has its own time limit and writes under $OUT; a part that runs
# out of time leaves what it wrote. Pick parts with PARTS (default: all, in
# this order):
#   tests     tests/gpu (the flash-attention SGD comparison has never run)
#   first     benchmarks/first_step.py: the 1.3B first call cold, then warm
#             from the plan cache (issue 21 item 6: warm <= 10 s)
#   remat     benchmarks/remat.py: 1.3B at micro-batch 24 (issue 18 item 1)
#   dynamic   benchmarks/dynamic_lengths.py, peers in the same run (issue 17); DYNAMIC_ARGS adds arguments
#   attention benchmarks/attention_lengths.py: attention kernels and matmuls per length
#   tma       the attention kernels' tests, their sweep (pointers and TMA descriptors), then dynamic_lengths.py
#             (peers in the same run) with the fastest settings (--set)
#   triton_attention  benchmarks/probe_triton_attention.py (stepfx's attention kernels against flash and
#             cuDNN, block shapes swept), then their tests on CUDA and the symbolic-length step test
# Usage (from the repository root, on the device machine):
#   PARTS=tests,first bash benchmarks/gpu_session.sh
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
note() { echo "$1 rc=$2 at $(( $(date +%s) - start ))s" | tee -a "$OUT/timeline.txt"; }
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv > "$OUT/gpus.txt" 2>&1
for part in $(echo "${PARTS:-tests,first,remat,dynamic}" | tr ',' ' '); do
  case "$part" in
    tests)
      timeout "${TESTS_S:-150}" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu > "$OUT/gpu_tests.log" 2>&1
      note tests $? ;;
    first)
      timeout "${FIRST_S:-150}" python3 benchmarks/first_step.py --cache-dir "$OUT/plan_cache" --out "$OUT" > "$OUT/first_step.log" 2>&1
      note first $?
      rm -rf "$OUT/plan_cache" ;;
    remat)
      timeout "${REMAT_S:-300}" python3 benchmarks/remat.py --out "$OUT" ${REMAT_ARGS:-} > "$OUT/remat.log" 2>&1
      note remat $? ;;
    dynamic)
      timeout "${DYNAMIC_S:-330}" python3 benchmarks/dynamic_lengths.py --out "$OUT" ${DYNAMIC_ARGS:-} >> "$OUT/dynamic.log" 2>&1
      note dynamic $? ;;
    triton_attention)
      timeout "${PROBE_S:-200}" python3 benchmarks/probe_triton_attention.py --out "$OUT" > "$OUT/probe_triton_attention.log" 2>&1
      note probe $?
      timeout "${TESTS_S:-150}" python3 -m pytest -q -s -p no:cacheprovider tests/codegen/test_attention_kernels.py \
        "tests/gpu/test_cuda.py::test_symbolic_lengths_run_padded_cudnn_or_flash_attention" > "$OUT/attention_tests.log" 2>&1
      note attention_tests $? ;;
    tma)
      # the attention kernels through TMA descriptors: their tests, the sweep (pointers and TMA), then the
      # varying-length step with the fastest settings against its fixed-length step, eager and torch.compile
      timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/codegen/test_attention_kernels.py > "$OUT/attention_tests.log" 2>&1
      note attention_tests $?
      timeout "${PROBE_S:-200}" python3 benchmarks/probe_triton_attention.py --lengths 1674,2048 --settings-file "$OUT/settings.txt" --out "$OUT" > "$OUT/probe_triton_attention.log" 2>&1
      note probe $?
      timeout "${DYNAMIC_S:-260}" python3 benchmarks/dynamic_lengths.py --out "$OUT" --systems stepfx-codegen,stepfx-codegen-fixed,eager,compile \
        --attention-pad-multiple 0 --log-compiles --set "$(cat "$OUT/settings.txt" 2>/dev/null)" ${DYNAMIC_ARGS:-} >> "$OUT/dynamic.log" 2>&1
      note dynamic $? ;;
    attention)
      timeout "${ATTENTION_S:-120}" python3 benchmarks/attention_lengths.py --out "$OUT" > "$OUT/attention.log" 2>&1
      note attention $? ;;
    *) echo "unknown part $part" ;;
  esac
done
cat "$OUT/timeline.txt"
for f in "$OUT"/*.log; do echo "== $f"; tail -n 4 "$f" | cut -c1-600; done
