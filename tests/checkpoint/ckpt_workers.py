"""Rank functions for the checkpoint tests (module level: rank processes import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import stepfx
from tests.steps import lm_step, tiny_gpt, token_batches

GLOBAL_BATCH = 4


def config(stage: int, precision: str = "fp32", tp: int = 1) -> dict:
    cfg = {"gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                                           "stage3_param_persistence_threshold": 0}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def batches(n: int, seed: int = 123, tp: int = 1) -> list[torch.Tensor]:
    """The rank's rows of each global batch (GLOBAL_BATCH sequences); the ranks of a
    tensor-parallel group (consecutive ranks) take the same rows."""
    rank, size = world()
    rank, size = rank // tp, size // tp
    rows = GLOBAL_BATCH // size
    return [b[rank * rows:(rank + 1) * rows] for (b,) in token_batches(n, batch=GLOBAL_BATCH, seed=seed)]


def global_loss(loss) -> float:
    """The loss of the global batch: every rank holds the same number of
    tokens, so it is the mean of the ranks' losses."""
    value = loss.detach().float().reshape(1).clone()
    _, size = world()
    if size > 1:
        dist.all_reduce(value)
    return float(value) / size


def fresh(stage: int, precision: str, tp: int = 1):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, stepfx.parallelize(config(stage, precision, tp))(lm_step)


def whole_state(step, model) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state, gathered (a collective)."""
    out = {f"model/{k}": v.clone() for k, v in step.model_state_dict().items()}
    for name, state in step.optimizer_state().items():
        for key, value in state.items():
            out[f"optim/{name}/{key}"] = value.clone()
    return out


def train_then_save(directory: str, stage: int, precision: str, before: int, after: int, *, async_save: bool = False,
                    tp: int = 1):
    """``before`` steps, a save, ``after`` more steps: (losses after the save, whole state at the save, whole state at the end)."""
    model, opt, step = fresh(stage, precision, tp)
    data = batches(before + after, tp=tp)
    for b in data[:before]:
        step(model, opt, b)
    saved = whole_state(step, model)
    scale = step.loss_scale
    step.save_checkpoint(directory, client_state={"batches_seen": before, "note": "x"}, async_save=async_save)
    losses = [global_loss(step(model, opt, b)) for b in data[before:]]
    if async_save:
        step.wait_checkpoint()
    return losses, saved, whole_state(step, model), scale


def load_then_train(directory: str, stage: int, precision: str, before: int, after: int, *, tp: int = 1,
                    after_first_call: bool = False):
    """A fresh run loads the checkpoint, then takes the steps after the save:
    (client_state, the state right after loading — gathered after the first
    step's capture would change it, so read from the user's objects —, losses, whole state at the end)."""
    model, opt, step = fresh(stage, precision, tp)
    data = batches(before + after, tp=tp)
    if after_first_call:  # the run has its plan and holds its shards: the load fills them in place
        step(model, opt, data[0])
    _, client = step.load_checkpoint(directory, model=model, optimizer=opt)
    scale = step.loss_scale
    if after_first_call:
        loaded = whole_state(step, model)
        losses = [global_loss(step(model, opt, b)) for b in data[before:]]
        return client, loaded, losses, whole_state(step, model), scale, len(step.plans)
    names = {id(p): n for n, p in model.named_parameters()}
    loaded = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        for key, value in state.items():
            loaded[f"optim/{names[id(p)]}/{key}"] = value.detach().clone()
    losses = [global_loss(step(model, opt, b)) for b in data[before:]]
    return client, loaded, losses, whole_state(step, model), scale, len(step.plans)


def resume_in_place(directory: str, stage: int, precision: str, before: int, after: int):
    """One run saves after ``before`` steps, takes ``after`` more, loads the
    checkpoint back into itself (its ZeRO pieces), and takes the same
    ``after`` steps again: (losses first time, losses after the load, plans)."""
    model, opt, step = fresh(stage, precision)
    data = batches(before + after)
    for b in data[:before]:
        step(model, opt, b)
    step.save_checkpoint(directory, tag="t")
    first = [float(step(model, opt, b)) for b in data[before:]]
    step.load_checkpoint(directory)
    again = [float(step(model, opt, b)) for b in data[before:]]
    return first, again, len(step.plans)
