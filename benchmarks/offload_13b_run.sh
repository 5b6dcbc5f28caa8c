#!/usr/bin/env bash
# The 13B runs of issue 18 on one H200 (needs_h200: 13B does not fit 80 GB), in one device call:
# the update across steps at micro-batch 32, then the update within the step at 32 (or both at 24 where 32 did not fit).
export OUT
SYSTEMS=stepfx-offload-z3-across BENCH_S=270 BENCH_ARGS="--size 13B --batch 32 --gas 1 --recompute 0 --speculation off --warmup 1 --steps 3 --system-timeout 260" bash benchmarks/offload_gpu_run.sh 2>&1 | tail -4
if grep -q tokens_per_s $OUT/offload.jsonl; then B=32; SYS=stepfx-offload-z3; else B=24; SYS=stepfx-offload-z3-across,stepfx-offload-z3; fi
cp $OUT/offload.log $OUT/offload_first.log
SYSTEMS=$SYS BENCH_S=280 BENCH_ARGS="--size 13B --batch $B --gas 1 --recompute 0 --speculation off --warmup 1 --steps 3 --system-timeout 260" bash benchmarks/offload_gpu_run.sh 2>&1 | tail -4
nvidia-smi --query-gpu=name,power.limit,memory.total --format=csv,noheader
