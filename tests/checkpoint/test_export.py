"""Export to Hugging Face's safetensors layout (stepfx/checkpoint/export.py):
what transformers' from_pretrained loads back bitwise (fp32) or as the cast
(bf16), shard files and index exactly as transformers' own save_pretrained
cuts them, tied and shared tensors, crash safety, and export from
checkpoints written on one process and in chunks by two."""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network: every model is built locally

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import stepfx
from stepfx.checkpoint.checkpoint import CheckpointError
from stepfx.checkpoint.export import (
    INDEX_NAME,
    WEIGHTS_NAME,
    export_checkpoint,
    parse_size,
    resolve_dtype,
    save_pretrained,
    write_safetensors,
)
from tests.steps import hf_step, token_batches

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process, on purpose


def _from_pretrained(directory, **kwargs) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, **kwargs)
    return model.state_dict()


def _gpt2() -> torch.nn.Module:
    """A one-layer GPT-2 (tied input and output embeddings), built here: nothing is downloaded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _assert_same(loaded: dict, expected: dict, dtype: torch.dtype | None = None) -> None:
    assert set(loaded) == set(expected), set(loaded) ^ set(expected)
    for key, want in expected.items():
        if dtype is not None and want.is_floating_point():
            want = want.to(dtype)
        assert loaded[key].dtype == want.dtype and torch.equal(loaded[key], want), key


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


# -- write_safetensors --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_gpt2_state_dict_loads_back_in_from_pretrained(tmp_path, dtype):
    model = _gpt2()
    model.config.save_pretrained(tmp_path)
    written = write_safetensors(model.state_dict(), tmp_path, dtype=dtype)
    assert written == [WEIGHTS_NAME] and _files(tmp_path) == ["config.json", WEIGHTS_NAME]
    stored = safetensors_torch.load_file(tmp_path / WEIGHTS_NAME)
    assert "transformer.wte.weight" in stored and "lm_head.weight" not in stored  # tied: the first name holds it
    _assert_same(_from_pretrained(tmp_path, dtype=dtype or torch.float32), model.state_dict(), dtype)


def test_shards_and_index_are_the_ones_transformers_writes(tmp_path):
    model = _gpt2()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    model.save_pretrained(theirs, max_shard_size="4KB")
    model.config.save_pretrained(ours)
    written = write_safetensors(model.state_dict(), ours, max_shard_size="4KB")
    shards = sorted(n for n in _files(theirs) if n.startswith("model-"))
    assert len(shards) > 2 and written == shards + [INDEX_NAME]
    assert sorted(n for n in _files(ours) if n.startswith("model")) == shards + [INDEX_NAME]
    our_index, their_index = (json.loads((d / INDEX_NAME).read_text()) for d in (ours, theirs))
    assert our_index["weight_map"] == their_index["weight_map"]
    assert our_index["metadata"]["total_size"] == their_index["metadata"]["total_size"]
    for shard in shards:
        assert safetensors_torch.load_file(ours / shard).keys() == safetensors_torch.load_file(theirs / shard).keys()
    _assert_same(_from_pretrained(ours), model.state_dict())


def test_shared_storage_only_floating_tensors_cast_and_metadata(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    state = {
        "w": base.view(3, 4),
        "w_tied": base.view(3, 4),  # the same view: written once, under "w"
        "flat": base,  # another view of the same storage: a copy of its own
        "head": base[:6], "tail": base[6:],  # disjoint views of one storage: copies
        "steps": torch.tensor([3, 4], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }
    write_safetensors(state, tmp_path, dtype="fp16", metadata={"source": "test"})
    with safetensors_torch.safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        assert f.metadata() == {"format": "pt", "source": "test"}
    stored = safetensors_torch.load_file(tmp_path / WEIGHTS_NAME)
    assert set(stored) == set(state) - {"w_tied"}
    for key in ("w", "flat", "head", "tail"):
        assert stored[key].dtype == torch.float16 and torch.equal(stored[key], state[key].half())
    assert torch.equal(stored["steps"], state["steps"]) and torch.equal(stored["mask"], state["mask"])


def test_a_failed_export_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    model = _gpt2()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    write_safetensors(first, tmp_path, max_shard_size="4KB")
    before = {n: (tmp_path / n).read_bytes() for n in _files(tmp_path)}
    real, calls = safetensors_torch.save_file, []

    def fails_on_the_third_shard(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors_torch, "save_file", fails_on_the_third_shard)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors({k: v + 1 for k, v in first.items() if k != "lm_head.weight"}, tmp_path, max_shard_size="4KB")
    assert {n: (tmp_path / n).read_bytes() for n in _files(tmp_path)} == before  # no temporary file left either
    monkeypatch.setattr(safetensors_torch, "save_file", real)
    write_safetensors(first, tmp_path, max_shard_size="1MB")  # now one file: the old shards and index are gone
    assert _files(tmp_path) == [WEIGHTS_NAME]


def test_options_are_checked():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("10KB") == 10_000 and parse_size(123) == 123
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype(None) is None
    with pytest.raises(ValueError, match="KB, MB, GB or TB"):
        parse_size("5 parsecs")
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        resolve_dtype(torch.int8)


# -- export_checkpoint --------------------------------------------------------------------
def _write_stepfx_checkpoint(directory, tensors: dict[str, torch.Tensor], meta: dict, tag: str = "global_step7") -> None:
    """A checkpoint in the layout stepfx's saver writes: DCP "model/<key>" tensors plus stepfx.json and latest."""
    path = os.path.join(directory, tag)
    dcp.save({f"model/{k}": v for k, v in tensors.items()}, checkpoint_id=path, no_dist=True)
    meta = {"format": "stepfx-checkpoint", "version": 1, "world_size": 1, "zero_stage": 0,
            "model": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                      for k, v in tensors.items()},
            **meta}
    with open(os.path.join(path, "stepfx.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(tag)


@pytest.mark.parametrize("dtype,max_shard_size", [(None, "4KB"), ("bf16", "5GB")], ids=["fp32-sharded", "bf16"])
def test_export_of_a_checkpoint_loads_in_from_pretrained(tmp_path, dtype, max_shard_size):
    model = _gpt2()
    params = dict(model.named_parameters())  # as stepfx's saver: one name per tied parameter
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    _write_stepfx_checkpoint(ckpt, {k: v.detach() for k, v in params.items()}, {"hf_config": model.config.to_dict()})
    written = export_checkpoint(ckpt, out, dtype=dtype, max_shard_size=max_shard_size)
    assert written[0] == "config.json" and (INDEX_NAME in written) == (max_shard_size == "4KB")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["dtype"] == ("bfloat16" if dtype else "float32")
    want = torch.bfloat16 if dtype else torch.float32
    _assert_same(_from_pretrained(out, dtype=want), model.state_dict(), want)


def _save_in_pieces(directory: str) -> dict[str, torch.Tensor]:
    """Rank function: every tensor cut as ZeRO-3 cuts it (rank r holds the
    r-th flat element range) and saved as stepfx's saver saves pieces
    (layout.py: each range as boxes of the whole tensor), so the two ranks'
    files hold different chunks that the export must reassemble."""
    from stepfx.checkpoint.layout import ChunkSavePlanner, chunks_of

    torch.manual_seed(0)
    full = {"embed.weight": torch.randn(7, 3), "fc.weight": torch.randn(5, 7), "fc.bias": torch.randn(5),
            "norm.weight": torch.randn(3), "steps": torch.arange(9, dtype=torch.int64)}
    rank, size = dist.get_rank(), dist.get_world_size()
    state, shapes = {}, {}
    for key, value in full.items():
        per = -(-value.numel() // size)
        start, stop = min(rank * per, value.numel()), min((rank + 1) * per, value.numel())
        shapes[f"model/{key}"] = tuple(value.shape)
        for chunk in chunks_of(f"model/{key}", tuple(value.shape), value.reshape(-1)[start:stop].clone(), (start, stop)):
            state[ChunkSavePlanner.key(chunk.fqn, chunk.offsets)] = chunk.tensor
    path = os.path.join(directory, "t")
    dcp.save(state, checkpoint_id=path, planner=ChunkSavePlanner(shapes))
    if rank == 0:
        meta = {"format": "stepfx-checkpoint", "version": 1, "world_size": size, "zero_stage": 3,
                "model": {k: {"shape": list(v.shape), "dtype": str(v.dtype)[6:]} for k, v in full.items()}}
        with open(os.path.join(path, "stepfx.json"), "w") as f:
            json.dump(meta, f)
        with open(os.path.join(directory, "latest"), "w") as f:
            f.write("t")
    dist.barrier()
    return full


def test_export_reassembles_chunks_written_by_two_ranks(rank_pool, tmp_path):
    full = rank_pool(2).run(_save_in_pieces, str(tmp_path / "ckpt"))[0]
    chunks = [f for f in os.listdir(tmp_path / "ckpt" / "t") if f.endswith(".distcp")]
    assert len(chunks) == 2
    written = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", dtype="fp16", max_shard_size=60)
    assert len(written) > 2 and "config.json" not in written  # several loads of a shard each; no hf_config recorded
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    stored = {}
    for shard in set(index["weight_map"].values()):
        stored.update(safetensors_torch.load_file(tmp_path / "out" / shard))
    _assert_same(stored, full, torch.float16)
    assert list(index["weight_map"]) == sorted(full)  # sort_keys, as transformers writes it


def test_export_names_what_is_wrong(tmp_path):
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        export_checkpoint(tmp_path, tmp_path / "out")
    _write_stepfx_checkpoint(tmp_path, {"w": torch.ones(2)}, {"format": "something-else"})
    with pytest.raises(CheckpointError, match="not a stepfx checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")


# -- save_pretrained from a live run ---------------------------------------------------------
def _train_and_save_pretrained(directory: str):
    """Rank function: a ZeRO-3 step of a transformers GPT-2, then save_pretrained
    (bf16, in shards), then the whole state (both collectives on every rank)."""
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                               "gradient_clipping": 1.0})(hf_step)
    rank, size = dist.get_rank(), dist.get_world_size()
    (batch,) = token_batches(1, batch=2 * size)[0]
    step(model, optimizer, batch[rank * 2:(rank + 1) * 2])
    written = save_pretrained(step, directory, dtype="bf16", max_shard_size="8KB")
    return written, step.model_state_dict()


def test_save_pretrained_of_a_zero3_run_loads_in_from_pretrained(rank_pool, tmp_path):
    (written, state), (others, _) = rank_pool(2).run(_train_and_save_pretrained, str(tmp_path))
    assert others == [] and written[:2] == ["config.json", "generation_config.json"] and written[-1] == INDEX_NAME
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "bfloat16"
    _assert_same(_from_pretrained(tmp_path, dtype=torch.bfloat16), state, torch.bfloat16)
    trained = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(state[trained], _gpt2().state_dict()[trained])  # the run's weights, not the initial ones


def test_import_deepspeed_then_export_on_the_command_line(tmp_path, capsys):
    """``stepfx import-deepspeed`` then ``stepfx export``: DeepSpeed's ZeRO-3
    checkpoint of 2 ranks becomes safetensors holding its fp32 parameters."""
    from safetensors.torch import load_file

    from stepfx.cli import main

    data = os.path.join(os.path.dirname(__file__), "data", "deepspeed_z3_ws2")
    assert main(["import-deepspeed", data, str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--max-shard-size", "300"]) == 0
    printed = capsys.readouterr().out.split()
    assert any(p.endswith("model.safetensors.index.json") for p in printed)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    exported = {}
    for shard in sorted(set(index["weight_map"].values())):
        exported.update(load_file(str(tmp_path / "hf" / shard)))
    assert exported and all(t.dtype == torch.float32 for t in exported.values() if t.is_floating_point())
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
