"""import_deepspeed (stepfx/checkpoint/deepspeed_import.py) against
checkpoints the real DeepSpeed wrote (tests/checkpoint/data/, made by
make_deepspeed_checkpoints.py; DeepSpeed itself is not needed here): the
parameters bitwise equal to DeepSpeed's own zero_to_fp32, the Adam state
bitwise equal to what DeepSpeed's engine held, a stepfx run that continues
from it, and pickles that would run code refused."""
from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import pickletools
import shutil
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import stepfx
from stepfx.checkpoint import SafeReader, UnsafeCheckpointError, read_index
from stepfx.checkpoint.deepspeed_import import (
    DeepSpeedImportError,
    import_deepspeed,
    load_deepspeed_file,
)
from stepfx.checkpoint.export import WEIGHTS_NAME, export_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process, on purpose

DATA = os.path.join(os.path.dirname(__file__), "data")
FIXTURES = [f"z{stage}_ws{world}" for stage in (1, 2, 3) for world in (1, 2)]


def _fixture(name: str) -> str:
    return os.path.join(DATA, f"deepspeed_{name}")


def _read(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a stepfx checkpoint, read on this process."""
    saved = read_index(path).state_dict_metadata
    out = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in saved.items()}
    dcp.load(out, storage_reader=SafeReader(path), no_dist=True)
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_import_equals_deepspeeds_own_consolidation(tmp_path, name):
    src = _fixture(name)
    with open(os.path.join(src, "expected.json")) as f:
        expected = json.load(f)
    path = import_deepspeed(src, tmp_path)
    assert path == str(tmp_path / expected["tag"]) and (tmp_path / "latest").read_text() == expected["tag"]
    got = _read(path)
    model = {k.removeprefix("model/"): v for k, v in got.items() if k.startswith("model/")}
    want = safetensors_torch.load_file(os.path.join(src, "expected_model.safetensors"))
    if expected["zero_stage"] == 1:
        # zero_to_fp32 drops the frozen parameters of stage-1 runs; the module holds them (never trained, so
        # they are the same as in the stage-2 fixture)
        frozen = safetensors_torch.load_file(os.path.join(_fixture("z2_ws1"), "expected_model.safetensors"))
        want.update((k, v) for k, v in frozen.items() if k.startswith("frozen."))
    assert set(model) == set(want) and "head.weight" not in model  # tied: the first name only, as stepfx saves it
    for key, value in want.items():
        # trained parameters: fp32 masters, bitwise; frozen ones: the bf16 DeepSpeed keeps, cast up exactly
        assert model[key].dtype == (torch.int64 if key == "seen" else torch.float32), key
        assert torch.equal(model[key].to(value.dtype), value) and torch.equal(model[key], value.to(model[key].dtype)), key
    optim = safetensors_torch.load_file(os.path.join(src, "expected_optim.safetensors"))
    trained = [n for g in expected["param_groups"] for n in g["params"]]
    assert {k for k in got if k.startswith("optim/")} == {f"optim/{n}/{s}" for n in trained
                                                        for s in ("exp_avg", "exp_avg_sq", "step")}
    for key, value in optim.items():
        assert torch.equal(got[f"optim/{key}"], value), key
    for n in trained:
        assert got[f"optim/{n}/step"].dtype == torch.float32 and float(got[f"optim/{n}/step"]) == expected["global_steps"]

    with open(os.path.join(path, "stepfx.json")) as f:
        meta = json.load(f)
    assert meta["source"] == "deepspeed" and meta["updates"] == expected["global_steps"] == meta["micro_steps"]
    assert (meta["world_size"], meta["zero_stage"]) == (expected["world_size"], expected["zero_stage"])
    assert meta["precision"] == "bf16"
    assert meta["optimizer"]["type"] == "AdamW"
    groups = [dict(g["__dict__"]) for g in meta["optimizer"]["param_groups"]]
    for mine, theirs in zip(groups, expected["param_groups"], strict=True):
        assert mine["params"] == theirs["params"] and mine["lr"] == theirs["lr"]
        assert mine["weight_decay"] == theirs["weight_decay"] and mine["betas"] == {"__tuple__": theirs["betas"]}
    assert meta["lr_scheduler"] == {"type": "WarmupLR", "state": {"__dict__": [["last_batch_iteration", 2]]}}
    assert meta["deepspeed"]["version"] == expected["deepspeed"]


def test_the_pickled_globals_are_exactly_the_documented_ones():
    """What DeepSpeed's files name besides torch's own tensor machinery: the
    stand-ins of deepspeed_import.py must cover these, and nothing else is allowed."""
    named = set()
    for name in FIXTURES:
        for root, _, files in os.walk(_fixture(name)):
            for f in (f for f in files if f.endswith(".pt")):
                with zipfile.ZipFile(os.path.join(root, f)) as z:
                    data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
                strings = []
                for op, arg, _ in pickletools.genops(data):
                    if op.name == "GLOBAL":  # protocol 2, as torch.save writes: "module name"
                        named.add(arg.replace(" ", "."))
                    elif op.name == "STACK_GLOBAL":
                        named.add(f"{strings[-2]}.{strings[-1]}")
                    elif isinstance(arg, str):
                        strings.append(arg)
    assert {g for g in named if not g.startswith(("torch.", "collections."))} == {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
    optim = load_deepspeed_file(os.path.join(_fixture("z2_ws1"), "global_step3",
                                              "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
    assert optim["zero_stage"] == 2 and vars(optim["loss_scaler"]) == {"cur_scale": 1.0, "dynamic": False}
    assert vars(optim["param_slice_mappings"][1]["norm.bias"]) == {"numel": 5, "start": 5}


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)  # what an attacker's payload would do, harmlessly visible


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
@pytest.mark.parametrize("victim", ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_a_file_that_would_run_code_is_refused(tmp_path, victim, legacy):
    src = tmp_path / "ds"
    shutil.copytree(_fixture("z1_ws1"), src)
    marker = str(tmp_path / "pwned")
    payload = {"optimizer_state_dict": {"zero_stage": _RunsCode(marker)}, "module": _RunsCode(marker)}
    target = src / "global_step3" / victim
    if legacy:
        target.write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, target)
    names = "it asks to load (os|posix).makedirs" if not legacy else "torch's weights-only unpickler refused it"
    with pytest.raises(UnsafeCheckpointError, match=rf"{victim}: refusing to load this DeepSpeed file: {names}"):
        import_deepspeed(src, tmp_path / "out")
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out")


def test_client_state_with_an_argparse_namespace_is_kept(tmp_path):
    """Megatron-DeepSpeed saves its argparse ``args`` and counters as client state beside DeepSpeed's keys."""
    src = tmp_path / "ds"
    shutil.copytree(_fixture("z1_ws1"), src)
    target = src / "global_step3" / "mp_rank_00_model_states.pt"
    states = load_deepspeed_file(target)
    states.update(args=argparse.Namespace(lr=0.5, micro_batch_size=2, tokenizer="gpt2"), iteration=7,
                  consumed=torch.tensor([1, 2, 3]))
    torch.save(states, target)
    path = import_deepspeed(src, tmp_path / "out")
    with open(os.path.join(path, "stepfx.json")) as f:
        client = json.load(f)["client_state"]
    assert client == {"__dict__": [
        ["args", {"__dict__": [["lr", 0.5], ["micro_batch_size", 2], ["tokenizer", "gpt2"]]}],
        ["iteration", 7], ["consumed", {"__tensor__": "client/0"}]]}
    assert torch.equal(_read(path)["client/0"], torch.tensor([1, 2, 3]))


def test_what_cannot_be_imported_is_named(tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(_fixture("z2_ws2"), src)
    with pytest.raises(DeepSpeedImportError, match="no 'latest' file"):
        import_deepspeed(src / "global_step3", tmp_path / "out")
    import_deepspeed(src, tmp_path / "out")
    with pytest.raises(DeepSpeedImportError, match="exists"):
        import_deepspeed(src, tmp_path / "out")
    os.remove(src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(DeepSpeedImportError, match="partitioned over 2 ranks but has 1"):
        import_deepspeed(src, tmp_path / "out2")
    os.rename(src / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
              src / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(DeepSpeedImportError, match="tensor-parallel"):
        import_deepspeed(src, tmp_path / "out2")


def test_import_then_export_is_zero_to_fp32_as_safetensors(tmp_path):
    src = _fixture("z3_ws2")
    import_deepspeed(src, tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    stored = safetensors_torch.load_file(tmp_path / "out" / WEIGHTS_NAME)
    want = safetensors_torch.load_file(os.path.join(src, "expected_model.safetensors"))
    assert set(stored) == set(want)
    for key, value in want.items():
        assert torch.equal(stored[key], value.to(stored[key].dtype)), key


# -- a DeepSpeed run continued in stepfx --------------------------------------------------------
class Tiny(nn.Module):
    """The generator's model (make_deepspeed_checkpoints.py), less its buffer update."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.norm = nn.LayerNorm(5)
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("temperature", torch.tensor([1.5]))

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        h = h + self.fc2(torch.relu(self.fc1(h))) + self.frozen(h)
        return self.head(h) / self.temperature


def _train_step(model, optimizer, ids):
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _optimizer(model: Tiny) -> torch.optim.AdamW:
    decay = [model.embed.weight, model.fc1.weight, model.fc2.weight]
    rest = [model.norm.weight, model.norm.bias, model.fc1.bias, model.fc2.bias]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest}], lr=1.0, foreach=False)


def test_a_deepspeed_run_continues_in_stepfx(tmp_path):
    src = _fixture("z3_ws2")
    import_deepspeed(src, tmp_path)
    torch.manual_seed(1)
    model = Tiny()
    optimizer = _optimizer(model)
    step = stepfx.parallelize({"zero_optimization": {"stage": 1}, "gradient_clipping": 0})(_train_step)
    step.load_checkpoint(str(tmp_path), model=model, optimizer=optimizer)
    assert step.updates == 3
    assert optimizer.param_groups[0]["lr"] == 0.004 and optimizer.param_groups[0]["weight_decay"] == 0.1  # DeepSpeed's
    want = safetensors_torch.load_file(os.path.join(src, "expected_model.safetensors"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key if key != "head.weight" else "embed.weight"].to(value.dtype)), key
    optim = safetensors_torch.load_file(os.path.join(src, "expected_optim.safetensors"))
    assert torch.equal(optimizer.state[model.fc1.weight]["exp_avg_sq"], optim["fc1.weight/exp_avg_sq"])

    reference = copy.deepcopy(model)
    ref_optimizer = _optimizer(reference)
    ref_optimizer.load_state_dict(optimizer.state_dict())
    ids = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(5))
    loss = step(model, optimizer, ids)
    ref_loss = _train_step(reference, ref_optimizer, ids).detach()
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for (key, value), ref in zip(step.model_state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6, msg=key)
    assert float(step.optimizer_state()["fc1.weight"]["step"]) == 4  # bias correction goes on from DeepSpeed's count
