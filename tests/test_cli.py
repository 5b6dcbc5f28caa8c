"""The command line: ``stepfx check`` and ``stepfx report`` (stepfx/cli.py).

A few runs in subprocesses (``python -m stepfx``: the entry point, exit
statuses, what reaches stdout/stderr); the 40 published configs and the
finer cases in-process through ``main(argv)``, which is the same code
without a second interpreter's start-up (a few seconds each).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stepfx import cli
from stepfx.cli import check_config, environment_report, main

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = Path(__file__).parent / "config" / "ds_configs"
FILES = sorted(CONFIGS.glob("*.json"))
REJECTED = {"18": "zero_optimization.stage3_param_persitence_threshold", "35": "communication_data_type"}


def config_file(number: str) -> Path:
    (path,) = CONFIGS.glob(f"{number}_*.json")
    return path


def check_json(capsys, *argv: str) -> tuple[int, dict]:
    status = main(["check", *argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def write(tmp_path: Path, text: str, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- subprocesses --------------------------------------------------------------
# one xdist worker runs all four, so the module fixture starts its processes once (make test runs -n 2)
SUBPROCESSES = pytest.mark.xdist_group("stepfx-cli-subprocesses")
BAD_JSON = '{\n  "train_batch_size": 8,\n  "fp16" {}\n}\n'


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``python -m stepfx`` four times, started together: each spends most of
    its ~3 s importing torch, so running them side by side keeps this file fast.
    Name -> CompletedProcess, and "tmp": the folder their files are in."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "bad.json").write_text(BAD_JSON)
    triton_cache = tmp / "triton"
    (triton_cache / "KERNELHASH").mkdir(parents=True)
    (triton_cache / "KERNELHASH" / "k.cubin").write_bytes(b"x" * 100)
    (triton_cache / "k.json").write_bytes(b"y" * 20)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(triton_cache),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "absent")}
    argvs = {"valid": ["check", str(config_file("04"))], "invalid": ["check", str(config_file("18"))],
             "bad json": ["check", str(tmp / "bad.json")], "report": ["report", "--json"]}
    started = {name: subprocess.Popen([sys.executable, "-m", "stepfx", *argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
               for name, argv in argvs.items()}
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    done["tmp"] = tmp
    return done


@SUBPROCESSES
def test_subprocess_check_valid_config_exits_0_with_summary(runs):
    done = runs["valid"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"{config_file('04')}: valid")
    assert "note:" not in done.stderr and "warning:" not in done.stderr  # findings go to stdout


@SUBPROCESSES
def test_subprocess_check_rejected_config_exits_1_naming_key_and_suggestion(runs):
    done = runs["invalid"]
    assert done.returncode == 1
    assert "error: zero_optimization.stage3_param_persitence_threshold: unknown key" in done.stdout
    assert "Did you mean 'stage3_param_persistence_threshold'?" in done.stdout
    assert done.stdout.splitlines()[-1] == f"{config_file('18')}: invalid (1 error)"


@SUBPROCESSES
def test_subprocess_check_bad_json_exits_2_with_line_and_column(runs):
    done = runs["bad json"]
    assert done.returncode == 2
    assert "Expecting ':' delimiter at line 3 column 10" in done.stderr
    assert done.stdout == ""


@SUBPROCESSES
def test_subprocess_report_json(runs):
    done = runs["report"]
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["stepfx"] == "0.1.0"
    assert report["torch"]["cuda available"] == torch.cuda.is_available()
    assert len(report["devices"]) == torch.cuda.device_count()
    assert report["distributed backends"]["gloo"] is torch.distributed.is_gloo_available()
    assert report["kernel caches"]["triton"] == {"path": str(runs["tmp"] / "triton"), "exists": True,
                                                 "entries": 2, "files": 2, "bytes": 120}
    assert report["kernel caches"]["inductor"]["exists"] is False
    assert not (runs["tmp"] / "absent").exists()  # reporting creates nothing


# -- check, in-process ------------------------------------------------------------
def test_all_forty_configs_are_here():
    assert len(FILES) == 40


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name[:2])
def test_check_accepts_the_38_and_rejects_the_2_deepspeed_rejects(capsys, path):
    status, report = check_json(capsys, str(path))
    number = path.name[:2]
    if number in REJECTED:
        assert (status, report["valid"]) == (1, False)
        assert [e["key"] for e in report["errors"]] == [REJECTED[number]]
    else:
        assert (status, report["valid"], report["errors"]) == (0, True, [])
    for finding in report["errors"] + report["warnings"] + report["notes"]:
        assert finding["key"] and finding["message"].startswith(finding["key"] + ": "), finding


def test_check_error_carries_the_suggestion(capsys):
    _, report = check_json(capsys, str(config_file("18")))
    assert report["errors"][0]["suggestion"] == "stage3_param_persistence_threshold"


def test_check_warning_names_key_and_closest_known_key(capsys):
    status, report = check_json(capsys, str(config_file("40")))
    assert status == 0
    (warning,) = [w for w in report["warnings"] if w["key"] == "tensorboard-dir"]
    assert warning["suggestion"] == "tensorboard"


def test_check_warns_about_what_the_first_call_rejects(capsys):
    status, report = check_json(capsys, str(config_file("20")))  # OneBitAdam: DeepSpeed builds it, stepfx cannot
    assert status == 0
    (warning,) = [w for w in report["warnings"] if w["key"] == "optimizer.type"]
    assert "'OneBitAdam'" in warning["message"] and "first call" in warning["message"]


def test_check_warns_about_implicit_gradient_clipping(capsys, tmp_path):
    status, report = check_json(capsys, write(tmp_path, '{"train_batch_size": 8}'))
    assert status == 0
    (warning,) = report["warnings"]
    assert warning["key"] == "gradient_clipping" and '"gradient_clipping": 0' in warning["message"]


def test_check_notes_auto_values_and_keys_not_applied(capsys):
    _, report = check_json(capsys, str(config_file("01")))
    notes = {n["key"]: n["message"] for n in report["notes"]}
    assert "resolve_auto" in notes["optimizer.params.lr"]
    assert "accepted" in notes["zero_optimization.allgather_bucket_size"]
    assert "zero_optimization.offload_optimizer.device" not in notes  # applied (passes/memory/offload_optimizer)


def test_check_world_size_runs_deepspeeds_batch_arithmetic(capsys, tmp_path):
    path = write(tmp_path, '{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, '
                 '"gradient_accumulation_steps": 1, "gradient_clipping": 0}')
    assert check_json(capsys, path)[0] == 0  # without a world size the arithmetic is not checked
    status, report = check_json(capsys, path, "--world-size", "2")
    assert status == 1
    assert report["errors"][0]["key"] == "train_batch_size"
    assert "10 != 4 * 1 * 2" in report["errors"][0]["message"]
    status, report = check_json(capsys, str(config_file("38")), "--world-size", "4")
    assert status == 0
    assert any("gradient_accumulation_steps=15" in n["message"] for n in report["notes"])


def test_check_duplicate_keys_are_an_error(capsys, tmp_path):
    status, report = check_json(capsys, write(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}'))
    assert status == 1
    assert report["errors"][0]["key"] == "train_batch_size"


def test_check_bad_json_in_process(capsys, tmp_path):
    status, report = check_json(capsys, write(tmp_path, BAD_JSON))
    assert (status, report["readable"]) == (2, False)
    assert (report["errors"][0]["line"], report["errors"][0]["column"]) == (3, 10)


def test_check_unreadable_file_is_a_usage_error(capsys, tmp_path):
    assert main(["check", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "missing.json: unreadable" in err
    result = check_config(tmp_path / "missing.json")
    assert not result.readable and result.exit_status() == 2


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert "check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["check", "x.json", "--world-size", "0"])
    assert info.value.code == 2


# -- report, in-process --------------------------------------------------------------
def test_report_text_lists_every_section(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    for section in ("versions", "torch", "devices", "distributed backends", "triton", "kernel caches"):
        assert f"\n{section}\n" in out
    assert f"{tmp_path}: 0 entries, 0 files, 0 B" in out
    if not torch.cuda.is_available():
        assert "no CUDA device" in out


def test_report_reads_triton_interpret_from_the_given_environment(tmp_path):
    env = {"TRITON_INTERPRET": "1", "TRITON_HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    report = environment_report(env)
    assert report["triton"]["TRITON_INTERPRET"] == "1"
    assert report["triton"]["stepfx kernels on cpu"].startswith("yes")
    assert report["kernel caches"]["triton"]["path"] == str(tmp_path / ".triton" / "cache")
    assert report["kernel caches"]["inductor"]["path"] == str(tmp_path)
    assert environment_report({})["triton"]["stepfx kernels on cpu"].startswith("no")


def test_commands_table_drives_the_parser():
    parser = cli.build_parser()
    assert parser.parse_args(["report"]).run is cli.COMMANDS[1].run
    extra = cli.Command("noop", "does nothing", lambda p: None, lambda a: 0)
    assert cli.build_parser((*cli.COMMANDS, extra)).parse_args(["noop"]).run(None) == 0


# -- bisect -------------------------------------------------------------------------
def test_bisect_a_correct_plan_exits_0(tmp_path, capsys):
    config = write(tmp_path, '{"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}')
    status = main(["bisect", "tests.steps:tiny_gpt", config, "--batch", "2x9", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("no divergence")


def test_bisect_names_a_broken_pass_and_exits_1(tmp_path, capsys, monkeypatch):
    import stepfx.api
    from stepfx.passes import PIPELINE, PipelineEntry
    from tests.report.test_bisect import perturb_one_node

    fn, chosen = perturb_one_node(0.4)
    monkeypatch.setattr(stepfx.api, "PIPELINE", (*PIPELINE[:4], PipelineEntry("perturb_one_node", fn, "test"),
                                                 *PIPELINE[4:]))
    torch.save((torch.randint(0, 64, (2, 9)),), tmp_path / "batch.pt")
    config = write(tmp_path, '{"gradient_clipping": 0}')
    status = main(["bisect", "tests.steps:tiny_gpt", config, "--batch-file", str(tmp_path / "batch.pt"),
                   "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 1
    assert "first divergent pass: " in out and "perturb_one_node" in out and chosen["node"] in out


def test_bisect_needs_one_batch(tmp_path, capsys):
    config = write(tmp_path, "{}")
    assert main(["bisect", "tests.steps:tiny_gpt", config]) == 2
    assert "--batch shapes or as --batch-file" in capsys.readouterr().err


def test_bisect_under_torchrun_on_two_ranks(tmp_path):
    """Every rank runs it with its own batch (the data-parallel reference); rank 0 prints."""
    config = write(tmp_path, '{"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STEPFX_CACHE_DIR": "off", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "stepfx", "bisect", "tests.steps:tiny_gpt", config, "--batch", "2x9", "--device", "cpu"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("no divergence") == 1  # rank 0 only
