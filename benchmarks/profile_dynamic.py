"""Where the time of steps on new sequence lengths goes: torch.profiler over
4 steps of new lengths (uniform [1024, 2048], micro-batch 4), stepfx
(codegen, dynamic "auto") and eager in one process, host and device tables.

    python3 benchmarks/profile_dynamic.py 350M > $OUT/profile.txt
"""
import torch, time, sys
import stepfx
from benchmarks.single_gpu import stepfx_step, eager_step
from stepfx.testing.models import GPT, gpt_config
from torch.profiler import profile, ProfilerActivity
size = sys.argv[1] if len(sys.argv) > 1 else "350M"
g = torch.Generator().manual_seed(1)
lens = torch.randint(1024, 2049, (16,), generator=g).tolist()
for kind in ("stepfx", "eager"):
    torch.manual_seed(0)
    cfg = gpt_config(size, seq_len=2048)
    model = GPT(cfg).cuda()
    if kind == "stepfx":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        step = stepfx.parallelize({"bf16": {"enabled": True}, "gradient_clipping": 1.0, "stepfx": {"codegen": True, "dynamic": "auto"}})(stepfx_step)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True); step = eager_step
    bs = [torch.randint(0, cfg.vocab_size, (4, t + 1), generator=g).cuda() for t in lens]
    for i in range(6): step(model, opt, bs[i]); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ts = []
        for i in range(6, 10):
            s = time.perf_counter(); step(model, opt, bs[i]); torch.cuda.synchronize(); ts.append(round((time.perf_counter() - s) * 1e3))
    print("=====", kind, "ms per step", ts, "lens", lens[6:10])
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
    if kind == "stepfx":
        print([p.guard is not None for p in step.plans])
    del model, opt, step, bs; torch.cuda.empty_cache()
