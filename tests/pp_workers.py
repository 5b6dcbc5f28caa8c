"""Functions that run on each rank of the test pool for the pipeline tests
(module level, so the rank processes can import them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import stepfx
from stepfx.passes.pipeline.partition_stages import PIPELINE_KEY


def pp_run(step_fn, make_model, make_optimizer, batches_per_dp, config) -> dict:
    """Train with ``config`` on this rank (its data-parallel rank's batches).
    Returns the losses, this rank's stages' parameters and optimizer state,
    and what the plan says of the stages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model()
    opt = make_optimizer(model)
    step = stepfx.parallelize(config)(step_fn)
    tp = max(1, config.get("tensor_parallel", {}).get("autotp_size", 1))
    dp_rank = (rank % (world // _stages(config, world))) // tp
    losses = [step(model, opt, *batch).item() for batch in batches_per_dp[dp_rank]]
    plan = step.plan.graph.signature.extra[PIPELINE_KEY]
    mine = set(step.plan.executor.my_stages)
    names = {id(p): n for n, p in model.named_parameters()}
    zero3 = config.get("zero_optimization", {}).get("stage") == 3
    if tp > 1 or zero3:  # split parameters live in the rank's store, ZeRO-3's on one rank of the stage: gathered
        gathered = step.model_state_dict()
        state = {n: gathered[n].clone() for n, _ in model.named_parameters() if plan.owner.get(n) in mine}
        optim = {n: {k: v.clone() for k, v in s.items()} for n, s in step.optimizer_state().items()
                 if plan.owner.get(n) in mine}
        return {"losses": losses, "state": state, "optimizer": optim, "stages": list(mine),
                "explain": step.explain(), "captures": len({id(p) for p in step.plans}),
                "kept": {n for n, p in model.named_parameters() if p.numel() > 0 and plan.owner.get(n) in mine},
                "fetched": {k: len(v) for k, v in getattr(step.plan.executor, "fetched", {}).items()},
                "p2p_bytes": step.plan.executor.p2p_bytes_sent,
                "fetch_order": _fetch_order(step.plan.executor)}
    state = {n: p.detach().clone() for n, p in model.named_parameters() if plan.owner.get(n) in mine}
    optim = {names[id(p)]: {k: v.clone() for k, v in s.items() if v.numel() > 0} for p, s in opt.state.items()
             if plan.owner.get(names[id(p)]) in mine}  # (empty: kept by another rank of the stage, ZeRO-1)
    optim = {n: s for n, s in optim.items() if s}
    return {"losses": losses, "state": state, "optimizer": optim, "owner": dict(plan.owner),
            "describe": plan.describe(), "stages": list(mine), "explain": step.explain(),
            "captures": len({id(p) for p in step.plans}),
            "sent_dtypes": _sent_dtypes(step.plan.executor.programs)}


def _fetch_order(executor) -> dict[str, list[tuple]]:
    """ZeRO-3 under a pipeline: per fetching program of this rank, its ops in
    order as ("start", elements) / ("wait", elements) / ("op",)."""
    out = {}
    for (kind, stage), positions in getattr(executor, "fetched", {}).items():
        if not positions:
            continue
        gm = executor.programs.programs[(kind, stage)].gm
        order = []
        for n in gm.graph.nodes:
            if n.op == "call_module" and n.target == "stepfx_fetch_start":
                order.append(("start", n.args[0].meta["val"].numel()))
            elif n.op == "call_module" and n.target == "stepfx_fetch_wait":
                order.append(("wait", n.meta["val"].numel()))
            elif n.op == "call_function":
                order.append(("op",))
        out[f"{kind}{stage}"] = order
    return out


def _sent_dtypes(programs) -> list[str]:
    """The dtypes of what the stages send each other per micro-batch."""
    names = {n for sends in programs.send_forward + programs.send_backward for n in sends}
    return sorted({str(programs.specs[n][1]) for n in names})


def _stages(config: dict, world: int) -> int:
    stages = config.get("pipeline", {}).get("stages", "auto")
    if stages == "auto":
        dp = config.get("stepfx", {}).get("pipeline", {}).get("data_parallel", 1)
        return world // dp
    return stages


def hf_gpt2_no_dropout():
    """tests.steps.hf_gpt2 without dropout: each pipeline rank draws its own
    random numbers, so dropout masks cannot equal the single-process run's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def fp16_overflow_run(config) -> dict:
    """Two steps at a loss scale of 2**40 (the fp16 gradients overflow), then
    one at the halved scales: what each rank's stage holds after each."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    from tests.steps import lm_step, tiny_gpt, token_batches

    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize(config)(lm_step)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"rank": rank, "scales": [], "changed": []}
    for (b,) in token_batches(3, batch=4, seed=1):
        step(model, opt, b)
        out["scales"].append(step.loss_scale)
        plan = step.plan.graph.signature.extra[PIPELINE_KEY]
        mine = set(step.plan.executor.my_stages)
        out["changed"].append(sorted(n for n, p in model.named_parameters()
                                     if plan.owner.get(n) in mine and not torch.equal(p, before[n])))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["skipped"] = step.skipped_steps
    return out


def failing_run(config, fail_rank: int) -> dict:
    """One good step, then a step whose backward raises on ``fail_rank``
    (the other ranks are then waiting for its gradients): what each rank
    raised, how long it took, and whether its stage's state is as before."""
    import time

    from stepfx.runtime.pipeline import PipelineExecutor
    from tests.steps import lm_step, tiny_gpt, token_batches

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize(config)(lm_step)
    (first, second) = [b for (b,) in token_batches(2, batch=4, seed=2)]
    step(model, opt, first)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == fail_rank:
        real = PipelineExecutor._call

        def broken(self, kind, stage, graph_inputs, values):
            if kind in ("B", "BI"):
                raise RuntimeError("injected failure in the backward")
            return real(self, kind, stage, graph_inputs, values)

        PipelineExecutor._call = broken
    started = time.perf_counter()
    try:
        step(model, opt, second)
        error = None
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == fail_rank:
            PipelineExecutor._call = real
    return {"error": error, "seconds": time.perf_counter() - started,
            "unchanged": all(torch.equal(p, before[n]) for n, p in model.named_parameters())}


def train_and_save(config, directory: str) -> dict:
    """Two pipelined steps, a checkpoint: this rank's stages' parameters and momentum."""
    from tests.steps import lm_step, tiny_gpt, token_batches

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = stepfx.parallelize(config)(lm_step)
    for (b,) in token_batches(2, batch=4, seed=4):
        step(model, opt, b)
    step.save_checkpoint(directory, tag="t")
    if "tensor_parallel" in config or config.get("zero_optimization", {}).get("stage") == 3:
        # split parameters live as shards on the ranks, ZeRO-3's on one rank of the stage: gathered (collectives)
        state = step.optimizer_state()
        whole = step.model_state_dict()
        return {"params": {n: whole[n] for n, _ in model.named_parameters()},  # (not the tied head's alias)
                "momentum": {n: s["momentum_buffer"] for n, s in state.items()}}
    plan = step.plan.graph.signature.extra[PIPELINE_KEY]
    mine = set(step.plan.executor.my_stages)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters() if plan.owner[n] in mine},
            "momentum": {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
                         if plan.owner[n] in mine}}


def memory_run(config) -> dict:
    """Three pipelined steps with AdamW: the bytes of parameters and optimizer
    state this rank keeps, the captures, and the whole model and optimizer
    state gathered back (model_state_dict, optimizer_state: collectives)."""
    from tests.steps import lm_step, tiny_gpt, token_batches

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    whole = sum(p.numel() for p in model.parameters())
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, b).item() for (b,) in token_batches(3, batch=4, seed=6)]
    kept = sum(p.numel() for p in model.parameters())
    state_kept = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    gathered = step.model_state_dict()
    optim = step.optimizer_state()
    return {"losses": losses, "whole": whole, "kept": kept, "state_kept": state_kept,
            "captures": len({id(p) for p in step.plans}), "stages": list(getattr(step.plan.executor, "my_stages", [])),
            "gathered": {k: v.clone() for k, v in gathered.items()},
            "optimizer": {n: {k: v.clone() for k, v in s.items()} for n, s in optim.items()}}


def hf_qwen2():
    """A tiny Qwen2 (grouped-query attention, rotary tables from a buffer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


def monitored_run(config) -> list[float]:
    """Two pipelined steps with DeepSpeed's csv_monitor on: the losses the step returned."""
    from tests.steps import lm_step, tiny_gpt, token_batches

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = stepfx.parallelize(config)(lm_step)
    losses = [step(model, opt, b).item() for (b,) in token_batches(2, batch=4, seed=8)]
    step._monitor.close()
    return losses
