"""Collectives give the right values on every rank, in real rank processes and in threads."""
import pytest
import torch
import torch.distributed as dist

from stepfx.testing import rank, run_threaded, world_size

N = 3   # elements per rank's chunk; odd, so a mixed-up chunk boundary shows

# torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _input(r: int, ws: int) -> torch.Tensor:
    """Rank r's input: ws chunks of N distinct values, different on every rank."""
    return torch.arange(ws * N, dtype=torch.float64) + 100.0 * r


def _collectives(api: str) -> dict:
    """Run all-reduce, all-gather and reduce-scatter through `api` on this rank."""
    r, ws = rank(), world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    x = _input(r, ws).to(device)
    if api == "dist":
        reduced = x.clone()
        dist.all_reduce(reduced)
        gathered = x.new_empty(ws * x.numel())
        _all_gather(gathered, x)
        scattered = x.new_empty(N)
        _reduce_scatter(scattered, x)
    else:
        f = torch.ops._c10d_functional
        group = dist.group.WORLD.group_name
        reduced = f.wait_tensor(f.all_reduce(x, "sum", group))
        gathered = f.wait_tensor(f.all_gather_into_tensor(x, ws, group))
        scattered = f.wait_tensor(f.reduce_scatter_tensor(x, "sum", ws, group))
    return {"rank": r, "world_size": ws, "all_reduce": reduced, "all_gather": gathered,
            "reduce_scatter": scattered, "device": str(x.device)}


def _expected(r: int, ws: int) -> dict:
    inputs = [_input(q, ws) for q in range(ws)]
    total = torch.stack(inputs).sum(0)
    return {"rank": r, "world_size": ws, "all_reduce": total, "all_gather": torch.cat(inputs),
            "reduce_scatter": total[r * N:(r + 1) * N]}


def _check(results: list[dict], ws: int, how: str) -> None:
    assert len(results) == ws
    for r, got in enumerate(results):
        want = _expected(r, ws)
        assert got.keys() - {"device"} == want.keys()
        for key in want:
            if isinstance(want[key], torch.Tensor):   # results come back as CPU tensors
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=0,
                                           msg=f"{key} on rank {r} of {ws} ({how})")
            else:
                assert got[key] == want[key], (key, r)


@pytest.mark.parametrize("api", ["dist", "functional"])
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("runner", ["pool", "threaded"])
def test_collectives_match_the_single_process_result(runner, ws, api, rank_pool):
    if runner == "pool":
        results = rank_pool(ws).run(_collectives, api)
    else:
        results = run_threaded(_collectives, ws, api)
    _check(results, ws, f"{runner}, {api}")


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("api", ["dist", "functional"])
def test_collectives_on_nccl_run_on_each_ranks_own_gpu(api, rank_pool):
    results = rank_pool(2, backend="nccl").run(_collectives, api)
    _check(results, 2, f"nccl, {api}")
    assert [got["device"] for got in results] == ["cuda:0", "cuda:1"]
