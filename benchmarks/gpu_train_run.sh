#!/usr/bin/env bash
# Issues 5 and 6 on a 2-GPU machine, in one call (device time is scarce);
# on a 1-GPU machine steps 1's two halves run one after the other and 2-3 are skipped:
# 1. in parallel: GPU 0 times the 1.3B single-GPU step (eager, torch.compile,
#    stepfx with codegen, same GPU one after another, profiled after timing);
#    GPU 1 runs the single-GPU CUDA tests and the multi-tensor kernel tests;
# 2. the ZeRO tests over NCCL on both GPUs (stages 0-3, bitwise / tracking);
# 3. train_gpt.py on both GPUs: stepfx ZeRO 0-3 and the peers in one torchrun.
# Everything goes to $WORK (default /tmp/o) and is packed into $OUT/r.tgz
# (the device tool brings back at most 8 files). Knobs: SYSTEMS (train_gpt's
# list), TRAIN_S (its time limit), SINGLE=0 skips the single-GPU timing, MULTIGPU=0 the NCCL tests,
# SINGLE_SYSTEMS its systems (SINGLE_S its time limit), SWEEP=1 first runs optimizer_sweep.py (SWEEP_ARGS its flags), KSWEEP=1 kernel_sweep.py (KSWEEP_ARGS; KBEST=1 times the step with its fastest geometries), TESTS=0 skips the GPU tests, SINGLE_PROFILE=1 profiles them (SINGLE_TRACE: systems whose Chrome trace is kept), TRACE=1 keeps rank 0's trace of train_gpt's profiled systems, DEEPSPEED wheels are installed from .whl/
# when present (see benchmarks/README.md).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
OUT=${OUT:-/tmp/out}
W=${WORK:-/tmp/o}
mkdir -p "$OUT" "$W"
start=$(date +%s)
mark() { echo "$1 rc=$2 at $(( $(date +%s) - start ))s" >> "$W/timeline.txt"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$W/gpus.txt" 2>&1
NGPU=$(nvidia-smi -L | grep -c '^GPU')
# clocks, power and throttle reasons once a second: a system timed later on a hotter GPU shows here
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -l 1 > "$W/smi.csv" 2>&1 &
SMI=$!
TEST_GPU=$(( NGPU > 1 ? 1 : 0 ))
if [ "${SWEEP:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/optimizer_sweep.py --out "$W" ${SWEEP_ARGS:-} > "$W/optimizer_sweep.log" 2>&1
  mark optimizer_sweep $?
fi
if [ "${KSWEEP:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/kernel_sweep.py --out "$W" ${KSWEEP_ARGS:-} > "$W/kernel_sweep.log" 2>&1
  mark kernel_sweep $?
  # KBEST=1: the single-GPU step runs with the sweep's fastest launch geometries
  if [ "${KBEST:-0}" = 1 ]; then SINGLE_SET=$(python3 benchmarks/kernel_sweep.py --best "$W/kernel_sweep.jsonl"); echo "set $SINGLE_SET" >> "$W/timeline.txt"; fi
fi
PIDS=()
[ "${SINGLE:-1}" = 1 ] && (
  CUDA_VISIBLE_DEVICES=0 timeout "${SINGLE_S:-240}" python3 benchmarks/single_gpu.py --systems "${SINGLE_SYSTEMS:-eager,compile,stepfx-codegen,stepfx-codegen-graphs}" \
    --warmup 5 --steps 20 ${SINGLE_PROFILE:+--profile} --trace "${SINGLE_TRACE:-}" --set "${SINGLE_SET:-}" --out "$W" > "$W/single_gpu.log" 2>&1
  mark single_gpu $?
) &
PIDS+=($!)
if [ "$NGPU" = 1 ]; then wait "${PIDS[@]}"; PIDS=(); fi  # never a bare wait: nvidia-smi runs in the background
[ "${TESTS:-1}" = 1 ] && (
  CUDA_VISIBLE_DEVICES=$TEST_GPU timeout 130 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu > "$W/gpu_tests.log" 2>&1
  mark gpu_tests $?
  CUDA_VISIBLE_DEVICES=$TEST_GPU timeout "${CODEGEN_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/codegen -k "many or multi or cast_pack or column or gelu or add_layer_norm or residual or grad_input" > "$W/codegen_tests.log" 2>&1
  mark codegen_tests $?
) &
PIDS+=($!)
wait "${PIDS[@]}"
if [ "$NGPU" -lt 2 ]; then
  echo "one GPU: no NCCL tests, no train_gpt" >> "$W/timeline.txt"
  MULTIGPU=0 SKIP_TRAIN=1
fi
if [ "${MULTIGPU:-1}" = 1 ]; then
  timeout 130 python3 -m pytest -q -s -p no:cacheprovider -m multigpu tests/gpu -k "zero_stages or codegen_under_zero or cuda_graph" > "$W/multigpu_tests.log" 2>&1
  mark multigpu_tests $?
fi
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  timeout "${TRAIN_S:-300}" torchrun --standalone --nproc_per_node 2 benchmarks/train_gpt.py \
    --systems "${SYSTEMS:-stepfx-3,fsdp2,stepfx-2,deepspeed-2,stepfx-0,ddp,stepfx-1,deepspeed-1,deepspeed-3,fsdp2-compile}" \
    --profile "${PROFILE:-stepfx-3,stepfx-0}" ${TRACE:+--trace} --out "$W" > "$W/train_gpt.log" 2>&1
  mark train_gpt $?
fi
kill $SMI 2>/dev/null
tar czf "$OUT/r.tgz" -C "$W" .
cat "$W/timeline.txt"
grep -h -o '"system": "[^"]*", "[gs].\{0,150\}' "$W"/*.jsonl
