"""GPU checks: capture and ZeRO on CUDA with NCCL. Skipped without GPUs.

Run on the GPU machine: ``python3 -m pytest -m "gpu or multigpu" -s``.
fp32 on CUDA: matmuls run in true fp32 (TF32 is off by default for
matmul), the same cuBLAS/attention kernels as eager for the same shapes,
so the captured step is expected to match eager to the last bits; the
assertions allow 1e-6 relative (measured numbers are printed). Optimizers
use foreach=False: stepfx traces the single-tensor algorithm, while eager
on CUDA defaults to the foreach kernels, whose rounding differs slightly.
"""
from __future__ import annotations

import pytest
import torch

from stepfx.testing.equivalence import assert_data_parallel_equivalent, assert_step_equivalent
from tests.steps import adamw_single_tensor as adamw
from tests.steps import dp_batches, hf_gpt2, hf_step, lm_step, tiny_gpt, token_batches
from tests.steps import sgd_single_tensor as sgd

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
multigpu = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def cuda_tiny_gpt():
    return tiny_gpt(dropout=0.1).cuda()


def cuda_tiny_gpt_nodrop():
    return tiny_gpt().cuda()


def cuda_gpt2():
    return hf_gpt2().cuda()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("make", [cuda_tiny_gpt, cuda_gpt2], ids=["gpt", "hf-gpt2"])
def test_capture_on_cuda_equals_eager(make):
    step = lm_step if make is cuda_tiny_gpt else hf_step
    report = assert_step_equivalent(step, make, adamw, token_batches(5), rtol=1e-6, atol=1e-7)
    print(f"\ncuda capture {make.__name__}: {report}")


@pytest.mark.multigpu
@multigpu
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("opt", [sgd, adamw], ids=["sgd", "adamw"])
def test_zero_stages_on_two_gpus_with_nccl(rank_pool, stage, opt):
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}
    report = assert_data_parallel_equivalent(
        rank_pool(2, "nccl"), lm_step, cuda_tiny_gpt_nodrop, opt, dp_batches(2, steps=4), config=config, rtol=1e-6, atol=1e-7
    )
    print(f"\nnccl stage {stage} {opt.__name__}: {report}")
    if stage == 3:
        assert "10_schedule_collectives" in report.explains[0] and "prefetched" in report.explains[0]
