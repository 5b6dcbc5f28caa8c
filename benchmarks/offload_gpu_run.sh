#!/usr/bin/env bash
# benchmarks/offload.py on the one-H200 machine with DeepSpeed as the peer, in one device call.
# The machine has no DeepSpeed and no registry: the wheels travel (gitignored, carry=["benchmarks/wheels"]):
#   DS_BUILD_OPS=0 pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation -w benchmarks/wheels
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d benchmarks/wheels \
#     hjson ninja packaging psutil py-cpuinfo "pydantic>=2" tqdm msgpack einops nvidia-ml-py numpy
# (installed --no-deps: pip does not see the machine's torch as a distribution).
# SYSTEMS picks benchmarks/offload.py's systems, BENCH_ARGS adds its other arguments; the 2026-12-04 call ran the default below.
set -u
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
W=benchmarks/wheels
(python3 -m pip install --no-index --find-links $W --no-deps deepspeed hjson ninja psutil py-cpuinfo pydantic pydantic-core annotated-types typing-inspection tqdm msgpack einops nvidia-ml-py numpy typing-extensions > $OUT/pip.log 2>&1 || python3 -m pip install --break-system-packages --no-index --find-links $W --no-deps deepspeed hjson ninja psutil py-cpuinfo pydantic pydantic-core annotated-types typing-inspection tqdm msgpack einops nvidia-ml-py numpy typing-extensions >> $OUT/pip.log 2>&1); tail -1 $OUT/pip.log
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
timeout ${BENCH_S:-200} python3 benchmarks/offload.py --out $OUT --systems ${SYSTEMS:-stepfx-offload-fused,deepspeed-offload-torch} ${BENCH_ARGS:-} > $OUT/offload.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - start ))s"
grep "^{" $OUT/offload.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); [r.pop(k,None) for k in ('command','date','torch','gpu','host_cpus','size','params','seq')]; r.get('timing',{}).pop('each_ms',None); print(json.dumps(r)[:700])"
grep -iE "error|Traceback" $OUT/offload.log | grep -v "^{" | head -8
