"""Functions that run on each rank of the test pool (module level, so the
rank processes can import them)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import stepfx
from tests.steps import lm_step, tiny_gpt, token_batches


def gpt_with_frozen_embedding():
    model = tiny_gpt()
    model.pos.weight.requires_grad_(False)
    return model


def one_block_gpt_with_frozen_embedding():
    """gpt_with_frozen_embedding with one block: what re-bucketing on
    freezing needs (frozen and trained parameters, several buckets) at half
    the capture cost."""
    model = tiny_gpt(n_layers=1)
    model.pos.weight.requires_grad_(False)
    return model


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)


def held_bytes(stage: int) -> dict:
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}})(lm_step)
    rank = dist.get_rank()
    for (batch,) in token_batches(2, seed=rank):
        step(model, opt, batch)
    store = step._store
    from stepfx.graph import Role

    state = sum(t.numel() for k, t in store.tensors.items() if k[0] is Role.OPTIMIZER_STATE and k[5] is not None)
    params_held = sum(t.numel() for k, t in store.tensors.items() if k[0] is Role.PARAM)
    module_params = sum(p.numel() for p in model.parameters())
    full_params = sum(p.numel() for p in tiny_gpt().parameters())
    layout = step.plan.graph.signature.extra["zero_layout"]
    return {
        "state_elements": state,
        "param_elements": params_held if stage == 3 else module_params,
        "module_param_elements": module_params,
        "slack": sum(b.padded - sum(p.numel for p in b.params) for b in layout.buckets),
        "full": {"state_elements": 2 * full_params, "param_elements": full_params},
    }


def frozen_held(bf16: bool) -> dict:
    """Stage 3 with a frozen position embedding: what this rank holds of it
    after two steps, what the module keeps, and the value sync_model()
    writes back."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = gpt_with_frozen_embedding()
    before = model.pos.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {"gradient_clipping": 0, "zero_optimization": {"stage": 3, "reduce_bucket_size": 500,
                                                             "stage3_param_persistence_threshold": 0}}
    if bf16:
        config["bf16"] = {"enabled": True}
    step = stepfx.parallelize(config)(lm_step)
    for (batch,) in token_batches(2, seed=rank):
        step(model, opt, batch)
    from stepfx.graph import Role

    held = sum(t.numel() for k, t in step._store.tensors.items() if k[0] is Role.PARAM and k[1] == "pos.weight")
    module_numel = model.pos.weight.numel()
    frozen_buckets = [b.index for b in step.plan.graph.signature.extra["zero_layout"].buckets if b.frozen]
    step.sync_model()
    return {"held": held, "module_numel": module_numel, "full": before.numel(), "frozen_buckets": frozen_buckets,
            "unchanged": torch.equal(model.pos.weight.detach(), before), "in_optimizer": model.pos.weight in opt.state}


def _freeze_reference(schedule) -> tuple[list[float], dict, dict]:
    """freeze_schedule's run in eager PyTorch, as data parallelism must
    compute it (data_parallel_reference: every rank's gradients summed in
    rank order and halved, one AdamW update; a frozen parameter has no
    gradient, so torch's AdamW skips it): this rank's losses, the model's
    state_dict and the optimizer state by parameter name."""
    from stepfx.testing.equivalence import data_parallel_reference

    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []

    def step_fn(model, optimizer, batch):  # called once per rank and step, rank by rank
        model.blocks[0].fc.weight.requires_grad_(not schedule[len(calls) // world])
        calls.append(None)
        return lm_step(model, optimizer, batch)

    outputs, model, opt = data_parallel_reference(step_fn, one_block_gpt_with_frozen_embedding,
                                                  lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                                                  [token_batches(len(schedule), seed=r) for r in range(world)])
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in opt.state.items()}
    return [out[rank].item() for out in outputs], model.state_dict(), state


def freeze_schedule(stages) -> dict:
    """Train the one-block tiny GPT (position embedding frozen) while
    blocks.0.fc.weight is frozen and unfrozen between steps, at each of ``stages``; per stage
    the worst difference to the eager data-parallel reference
    (:func:`_freeze_reference`) in losses, parameters and optimizer state,
    and how many plans it captured."""
    rank = dist.get_rank()
    # fc.weight frozen at step i? Plan A captured (step 2), B (3), A again (4: its plan reused), B again (5)
    schedule = [False, False, True, False, True]

    def run(stage):
        torch.manual_seed(0)
        model = one_block_gpt_with_frozen_embedding()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}})(lm_step)
        losses = []
        for (batch,), frozen in zip(token_batches(len(schedule), seed=rank), schedule):
            model.blocks[0].fc.weight.requires_grad_(not frozen)
            losses.append(step(model, opt, batch).item())
        return losses, step.model_state_dict(), step.optimizer_state(), len(step.plans)

    ref = _freeze_reference(schedule)
    out = {}
    for stage in stages:
        losses, params, state, plans = run(stage)
        out[stage] = {
            "losses": max(abs(a - b) for a, b in zip(losses, ref[0])),
            "params": max((params[k] - ref[1][k]).abs().max().item() for k in ref[1]),
            "state": max((state[n][k].float() - ref[2][n][k].float()).abs().max().item() for n in ref[2] for k in ref[2][n]),
            "same_state_keys": {n: sorted(v) for n, v in state.items()} == {n: sorted(v) for n, v in ref[2].items()},
            "plans": plans,
        }
    return out


def _outcome(fn) -> dict:
    start = time.time()
    try:
        fn()
        return {"error": None, "message": "", "seconds": time.time() - start}
    except Exception as exc:  # the test inspects what each rank raised
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.time() - start}


def mismatched_batches() -> dict:
    """Rank r brings a batch of 2 + r sequences (the collectives are the same)."""
    rank = dist.get_rank()
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 2}})(lm_step)
    batch = torch.randint(0, 64, (2 + rank, 9))
    return _outcome(lambda: step(model, opt, batch))


def mismatched_models() -> dict:
    rank = dist.get_rank()
    from stepfx.testing.models import GPT, gpt_config

    model = GPT(gpt_config("tiny", n_layers=2 + rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 1}})(lm_step)
    return _outcome(lambda: step(model, opt, torch.randint(0, 64, (2, 9))))


def _branchy_step(model, optimizer, idx):
    loss = lm_step(model, optimizer, idx) if dist.get_rank() == 0 else None
    if loss is None:
        logits = model(idx[:, :-1])
        if logits.sum() > 0:  # tensor-dependent control flow on rank 1 only
            logits = logits * 2
        loss = logits.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss


def one_rank_fails_capture() -> dict:
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 0}})(_branchy_step)
    return _outcome(lambda: step(model, opt, torch.randint(0, 64, (2, 9))))


def one_rank_fails_mid_step() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 2, "reduce_bucket_size": 500}})(lm_step)
    good = torch.randint(0, 64, (2, 9))
    step(model, opt, good)
    step(model, opt, good)
    # a second decorated step in the process shares stepfx's group: the abort must free it anyway
    # (gloo closes its connections only when the group object goes)
    other = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {"stage": 1}})(lm_step)
    small = tiny_gpt(n_layers=1)
    small_opt = torch.optim.SGD(small.parameters(), lr=0.1)
    other(small, small_opt, good)
    before = [p.detach().clone() for p in model.parameters()]
    bad = good.clone()
    if rank == 1:
        bad[0, 0] = 10_000  # out of vocabulary: fails inside the graph, on rank 1 only
    result = _outcome(lambda: step(model, opt, bad))
    result["params_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    result["other_step_after"] = _outcome(lambda: other(small, small_opt, good))["message"]
    return result


class MLPFactory:
    """A picklable model factory with parameters (hypothesis draws them)."""

    def __init__(self, sizes, frozen=()):
        self.sizes = tuple(sizes)
        self.frozen = tuple(frozen)  # indices into parameters(): requires_grad=False (the last one never)

    def __call__(self):
        from stepfx.testing.models import MLP

        model = MLP(self.sizes)
        params = list(model.parameters())
        for i in self.frozen:
            if i < len(params) - 1:
                params[i].requires_grad_(False)
        return model


class OptimizerFactory:
    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, model):
        ps = model.parameters()
        return {
            "sgd": lambda: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
            "sgd_plain": lambda: torch.optim.SGD(ps, lr=0.05),
            "adam": lambda: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
            "adamw": lambda: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "rmsprop": lambda: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
            "adagrad": lambda: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
            "adamax": lambda: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.01),
            "adadelta": lambda: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.01),
        }[self.kind]()


def mlp_rank_batches(world, steps, d_in, classes, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(3, d_in, generator=g), torch.randint(0, classes, (3,), generator=g)) for _ in range(steps)]
        for _ in range(world)
    ]


def accumulate(stage: int, k: int, optimizer: str = "sgd") -> dict:
    """k micro-batches with gradient accumulation under ZeRO against the data-
    parallel reference step on the k-times batch (fp32)."""
    from stepfx.testing.equivalence import compare_tensors, data_parallel_reference
    from tests import steps

    sgd = getattr(steps, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [token_batches(2 * k, seed=7 + 1000 * r) for r in range(world)]
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = sgd(model)
    cfg = {"gradient_accumulation_steps": k, "gradient_clipping": 0, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    step = stepfx.parallelize(cfg)(lm_step)
    for (batch,) in batches[rank]:
        step(model, opt, batch)
    state = step.model_state_dict()
    merged = [[(torch.cat([b[0] for b in bs[i * k : (i + 1) * k]]),) for i in range(2)] for bs in batches]
    torch.set_num_threads(1)
    _, ref, _ = data_parallel_reference(lm_step, tiny_gpt, sgd, merged)
    worst = 0.0
    for name, value in ref.state_dict().items():
        worst = max(worst, compare_tensors(name, state[name], value, 2e-6, 1e-8, normwise=True)[1])
    return {"max_rel": worst}


def fp16_overflow_on_one_rank(stage: int) -> dict:
    import torch.nn.functional as F

    from stepfx.testing.models import MLP

    def step_fn(model, optimizer, x, y, blowup):
        loss = F.cross_entropy(model(x).float(), y) * blowup
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP((8, 64, 64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}, "gradient_clipping": 0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}}
    step = stepfx.parallelize(cfg)(step_fn)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    for _ in range(2):
        step(model, opt, x, y, torch.tensor(1.0))
    before = {n: v.clone() for n, v in step.model_state_dict().items()}
    scale = step.loss_scale
    step(model, opt, x, y, torch.tensor(1e30 if rank == 1 else 1.0))
    after = step.model_state_dict()
    return {
        "skipped": step.skipped_steps,
        "scale_halved": step.loss_scale == scale / 2,
        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
    }


def precision_run(stage: int, precision: str, comm: str | None, steps: int, device: str = "cpu") -> dict:
    """``steps`` AdamW steps of the tiny GPT in bf16/fp16 under ZeRO ``stage``;
    the per-step losses and, from the final graph, the dtype every collective
    moves and where stage 3's forward gathers sit."""
    from stepfx.graph import META_PHASE, Phase
    from stepfx.passes.data_parallel.collectives import COLLECTIVE_OPS
    from tests.steps import adamw

    rank = dist.get_rank()
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    model = tiny_gpt().to(device)
    opt = adamw(model)
    block = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    cfg = {precision: block, "gradient_clipping": 0, "zero_optimization": {
        "stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}
    if comm:
        cfg["communication_data_type"] = comm
    step = stepfx.parallelize(cfg)(lm_step)
    losses = [float(step(model, opt, batch.to(device))) for (batch,) in token_batches(steps, seed=7 + 1000 * rank)]
    nodes = list(step.plan.graph.gm.graph.nodes)
    moved = {}
    for node in nodes:
        if node.target in COLLECTIVE_OPS and node.args[0].meta["val"].numel() > 1:  # not the overflow flag
            kind = node.target.__name__.split(".")[0].rstrip("_")  # all_reduce_ (in place) is an all_reduce
            moved.setdefault(kind, set()).add(str(node.args[0].meta["val"].dtype).replace("torch.", ""))
    gathers = [i for i, n in enumerate(nodes) if n.target in COLLECTIVE_OPS and "gather" in str(n.target) and n.meta.get(META_PHASE) is Phase.FORWARD]
    matmuls = [i for i, n in enumerate(nodes) if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)]
    interleaved = bool(gathers) and any(m < gathers[-1] for m in matmuls)
    return {"losses": losses, "moved": {k: sorted(v) for k, v in moved.items()},
            "skipped": step.skipped_steps, "interleaved": interleaved}


def bucket_packing_run(stage: int, pack: bool, steps: int = 2) -> dict:
    """``steps`` bf16 AdamW steps (two: the second reuses the plan, with
    Adam's state warm) of the tiny GPT under ZeRO ``stage`` with
    codegen (Triton's interpreter), the buckets packed by cast_pack
    (``fuse_bucket_packing``, every size) or by aten casts and cat; the
    losses, the parameters after, and how the final graph built its buckets
    and launches its Adam updates (every parameter sharded, small buckets:
    some parameters lie wholly on the other rank)."""
    from stepfx.passes.data_parallel import fuse_bucket_packing
    from tests.steps import adamw

    fuse_bucket_packing.MIN_NUMEL = 0  # this rank process only
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    cfg = {"bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0},
           "stepfx": {"codegen": True, "disable": [] if pack else ["fuse_bucket_packing"]}}
    step = stepfx.parallelize(cfg)(lm_step)
    losses = [float(step(model, opt, batch)) for (batch,) in token_batches(steps, seed=7 + 1000 * rank)]
    nodes = [n for n in step.plan.graph.gm.graph.nodes if n.op == "call_function"]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            # the buckets' packs (not batch_parameter_casts' one of the parameters' bf16 copies)
            "packs": sum(getattr(n.target, "__name__", "") == "pack" and not n.name.startswith("params16") for n in nodes),
            "cats": sum(n.target is torch.ops.aten.cat.default and n.name.startswith("bucket") for n in nodes),
            "scaled": sum(getattr(n.target, "__name__", "") == "pack" and n.kwargs.get("scale") == 0.5 for n in nodes),
            "divisions": sum(n.target is torch.ops.aten.div.Tensor and n.name.startswith(("grad_avg", "grad_shard"))
                             for n in nodes),
            "adam_step": sum(getattr(n.target, "__name__", "") == "adam_step" for n in nodes),
            "adam_step_many": sum(getattr(n.target, "__name__", "") == "adam_step_many" for n in nodes)}


def carried_copies_run(carry: bool, steps: int = 2) -> dict:
    """``steps`` bf16 AdamW steps (two: the second would read the copies the
    first carried) of the tiny GPT, data-parallel at ZeRO
    stage 0 with codegen, ``carry_parameter_copies`` on or off: the losses,
    the parameters after, what each rank carried and the pass's summary."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = {"bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "stepfx": {"codegen": True, "disable": [] if carry else ["carry_parameter_copies"]}}
    step = stepfx.parallelize(cfg)(lm_step)
    losses = [float(step(model, opt, batch)) for (batch,) in token_batches(steps, seed=7 + 1000 * rank)]
    summary = next((r.summary for r in step.plan.records if r.name == "carry_parameter_copies"), "")
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "carried": step.plan.executor.binding.carried_notes(), "summary": summary}


def graphs_run(stage: int, graphs_on: bool, codegen: bool, steps: int = 6, device: str = "cpu", min_segment: int = 1) -> dict:
    """``steps`` AdamW steps (learning rate decayed every step, clipping;
    the second plan captures on call 4 and replays on calls 5-6) of the
    tiny GPT under ZeRO ``stage``, replayed as CUDA graphs (on the CPU
    emulated: runtime/graphs.py's ``EMULATE``) or run eagerly; bf16 with
    codegen (on the CPU Triton's interpreter) when ``codegen``; every run of
    device ops captured when ``min_segment`` is 1. Losses (kept across
    steps), parameters after, and the executor's note."""
    from stepfx.runtime import graphs
    from tests.steps import adamw_single_tensor

    graphs.MIN_SEGMENT_OPS = min_segment
    rank = dist.get_rank()
    if device == "cpu":
        graphs.EMULATE = True  # this rank process only
    else:
        device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(0)
    model = tiny_gpt().to(device)
    opt = adamw_single_tensor(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
    cfg = {"gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                                           "stage3_param_persistence_threshold": 0},
           "stepfx": {"codegen": codegen, "cuda_graphs": graphs_on}}
    if codegen:
        cfg["bf16"] = {"enabled": True}
    step = stepfx.parallelize(cfg)(lm_step)
    losses = []
    for (batch,) in token_batches(steps, seed=7 + 1000 * rank):
        losses.append(step(model, opt, batch.to(device)))
        sched.step()
    step.sync_model()
    return {"losses": [float(x) for x in losses], "params": [p.detach().cpu().clone() for p in model.parameters()],
            "note": step.plan.executor.graphs_note}


def predicted_peaks_by_stage() -> dict:
    """This rank's predicted peak (bytes) of the tiny GPT's step at ZeRO stages 2 and 3 (the planner's figure)."""
    from stepfx.graph.accounting import estimate_memory

    peaks = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = stepfx.parallelize({"gradient_clipping": 0, "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}})(lm_step)
        step(model, opt, torch.randint(0, 64, (2, 9)))
        peaks[stage] = estimate_memory(step.plan.graph).peak
    return peaks


def delayed_update_run(steps: int) -> dict:
    """stepfx.delayed_parameter_update over the pool's ranks (bf16, ZeRO-3, host masters): the losses, then the
    parameters once read (which applies the pending update)."""
    from tests.steps import adamw, dp_batches

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = adamw(model)
    config = {"gradient_clipping": 1.0, "bf16": {"enabled": True},
              "stepfx": {"host_adam": "exact", "delayed_parameter_update": True},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "cpu"}}}
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, b).item() for (b,) in dp_batches(world, steps=steps)[rank]]
    return {"losses": losses, "params": step.model_state_dict()}


def own_clip_run(stage: int, own: bool, steps: int = 3) -> dict:
    """bf16 SGD steps of the tiny GPT on 2 ranks at ZeRO ``stage``, clipped to 0.5 by the step's own
    ``clip_grad_norm_(model.parameters(), 0.5)`` (``own``) or by ``gradient_clipping``: the parameters after
    (whole, ``model_state_dict``) and the norms the own clip returned."""
    from tests.capture.test_clip_in_step import norm_clipped_step

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = {"bf16": {"enabled": True}, "gradient_clipping": 0 if own else 0.5,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}
    step = stepfx.parallelize(cfg)(norm_clipped_step if own else lm_step)
    norms = []
    for (batch,) in token_batches(steps, seed=7 + 1000 * rank):
        out = step(model, opt, batch)
        if own:
            norms.append(float(out[1]))
    return {"params": {k: v.clone() for k, v in step.model_state_dict().items()}, "norms": norms}


def wrapped_model_run(wrap: str, stage: int) -> dict:
    """AdamW steps of an MLP with a batch norm on 2 ranks at ZeRO ``stage``, the model passed as is (``wrap``
    "none"), wrapped in DistributedDataParallel ("ddp"), or DDP over torch.compile ("ddp-compiled"): the losses and
    the whole parameters and buffers after (``model_state_dict``)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    passed = model
    if wrap == "ddp-compiled":
        passed = torch.nn.parallel.DistributedDataParallel(torch.compile(model, backend="eager"))
    elif wrap == "ddp":
        passed = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(passed.parameters(), lr=1e-2)
    step = stepfx.parallelize({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0,
                               "zero_optimization": {"stage": stage}})(mse_step)
    g = torch.Generator().manual_seed(rank)
    losses = [float(step(passed, opt, torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)).detach())
              for _ in range(3)]
    return {"losses": losses, "state": {k: v.clone() for k, v in step.model_state_dict().items()}}


def mse_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def fsdp_sharded_refusal() -> str:
    """The message stepfx gives a model FSDP2's fully_shard already sharded."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model)
    step = stepfx.parallelize({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0})(mse_step)
    try:
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8), torch.randn(4, 4))
    except TypeError as exc:
        return str(exc)
    return "no error"
