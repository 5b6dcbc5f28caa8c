"""stepfx.optimizer_builder: DeepSpeed's optimizer block -> a torch optimizer with the same update.

The update references below follow DeepSpeed's docs of FusedAdam
(``adam_w_mode``: decoupled weight decay, else L2 added to the gradient) and
the Adam paper; they are hand-written and do not use torch.optim.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from stepfx.config import ConfigError, ConfigWarning, OptimizerConfig, load_config, resolve_auto
from stepfx.optimizer_builder import SUPPORTED_TYPES, build_optimizer


def params(n=3):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, dtype=torch.float64))]


def build(type_, **kw):
    return build_optimizer(OptimizerConfig(type=type_, params=kw), params())


def group(opt):
    return opt.param_groups[0]


# --- which torch class, with which arguments ------------------------------------------------------------------

@pytest.mark.parametrize("type_, extra, cls", [
    ("Adam", {}, torch.optim.AdamW),  # adam_w_mode defaults to true: DeepSpeed's "Adam" is AdamW
    ("adam", {}, torch.optim.AdamW),  # DeepSpeed lower-cases its own names
    ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),  # AdamW wins over adam_w_mode
    ("ADAMW", {}, torch.optim.AdamW),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam),
    ("Adam", {"torch_adam": True}, torch.optim.AdamW),
    ("SGD", {}, torch.optim.SGD),
])
def test_type_and_adam_w_mode_pick_the_class(type_, extra, cls):
    assert type(build(type_, lr=0.01, **extra)) is cls


def test_fused_adam_defaults_not_torchs():
    # FusedAdam's weight_decay default is 0; torch's AdamW would use 0.01.
    g = group(build("AdamW"))
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["foreach"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0, False)
    # With torch_adam DeepSpeed calls torch's class with the params as given, so torch's defaults apply.
    assert group(build("AdamW", torch_adam=True))["weight_decay"] == 0.01


def test_foreach_off_unless_the_params_say_otherwise():
    assert group(build("SGD", lr=0.1))["foreach"] is False
    assert group(build("SGD", lr=0.1, foreach=True))["foreach"] is True
    assert group(build("Adam", torch_adam=True, foreach=True))["foreach"] is True


def test_param_groups_keep_their_own_hyperparameters():
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer(OptimizerConfig(type="AdamW", params={"lr": 0.01, "weight_decay": 0.1}),
                          [{"params": [w]}, {"params": [b], "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# --- the update is DeepSpeed's --------------------------------------------------------------------------------

def reference_adam(p, grads, lr, betas, eps, wd, decoupled):
    """Adam with bias correction; decoupled (AdamW, FusedAdam adam_w_mode=1) or L2 weight decay."""
    p = [float(x) for x in p]
    m, v = [0.0] * len(p), [0.0] * len(p)
    for step, grad in enumerate(grads, start=1):
        for i, g in enumerate(grad):
            if decoupled:
                p[i] *= 1 - lr * wd
            else:
                g = g + wd * p[i]
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[i] / (1 - betas[0]**step), v[i] / (1 - betas[1]**step)
            p[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
    return p


@pytest.mark.parametrize("type_, extra, decoupled", [("Adam", {}, True), ("Adam", {"adam_w_mode": False}, False),
                                                     ("AdamW", {}, True)])
def test_adam_update_matches_the_reference(type_, extra, decoupled):
    hyper = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3)
    ps = params()
    start = ps[0].detach().clone()
    opt = build_optimizer(OptimizerConfig(type=type_, params={**hyper, **extra}), ps)
    grads = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    for grad in grads:
        ps[0].grad = grad.clone()
        opt.step()
    want = reference_adam(start.tolist(), [g.tolist() for g in grads], hyper["lr"], hyper["betas"], hyper["eps"],
                          hyper["weight_decay"], decoupled)
    assert ps[0].tolist() == pytest.approx(want, rel=1e-12)


# --- errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("type_, kw, cls", [
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}, torch.optim.Adagrad),  # DeepSpeed's name, any case
    ("adagrad", {"lr": 0.1}, torch.optim.Adagrad),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True}, torch.optim.RMSprop),  # torch's, as spelled
    ("Adamax", {"lr": 0.002, "betas": [0.9, 0.99]}, torch.optim.Adamax),
    ("Adadelta", {"lr": 1.0, "rho": 0.95}, torch.optim.Adadelta),
])
def test_other_torch_optimizers_are_built_as_deepspeed_builds_them(type_, kw, cls):
    """DeepSpeed builds "adagrad" as torch's Adagrad (its CPU Adagrad only under offload) and any other type as
    getattr(torch.optim, type)(params, **params): the classes stepfx captures are built the same way."""
    opt = build(type_, **kw)
    assert type(opt) is cls and group(opt)["foreach"] is False
    assert all(group(opt)[k] == (tuple(v) if isinstance(v, list) else v) for k, v in kw.items())
    with pytest.raises(ConfigError) as info:
        build(type_, lr=0.1, momentun=0.9)
    assert info.value.path == "optimizer.params.momentun"


@pytest.mark.parametrize("type_", ["OneBitAdam", "ZeroOneAdam", "Lamb", "OneBitLamb", "Lion", "MuAdam",
                                   "Muon", "NAdam", "RAdam", "ASGD"])
def test_unsupported_types_name_optimizer_type(type_):
    with pytest.raises(ConfigError) as info:
        build(type_, lr=0.01)
    assert info.value.path == "optimizer.type" and info.value.value == type_
    assert repr(type_) in str(info.value) and ", ".join(SUPPORTED_TYPES) in str(info.value)


@pytest.mark.parametrize("type_, kw, path, fragment", [
    ("Adam", {"lr": 1e-3, "max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "gradient_clipping"),
    ("SGD", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "gradient_clipping"),
    ("Adam", {"lr": "auto"}, "optimizer.params.lr", "learning_rate="),
    ("AdamW", {"weight_decay": "auto"}, "optimizer.params.weight_decay", "weight_decay="),
    ("Adam", {"weight_decy": 0.1}, "optimizer.params.weight_decy", "Did you mean 'weight_decay'"),
    ("Adam", {"adamw_mode": False}, "optimizer.params.adamw_mode", "Did you mean 'adam_w_mode'"),
    ("Adam", {"foreach": False}, "optimizer.params.foreach", "torch_adam"),  # FusedAdam takes no foreach
    ("Adam", {"bias_correction": False}, "optimizer.params.bias_correction", "always corrects"),
    ("Adam", {"bias_correction": "no"}, "optimizer.params.bias_correction", "true or false"),
    ("Adam", {"amsgrad": True}, "optimizer.params.amsgrad", "FusedAdam raises"),
    ("Adam", {"torch_adam": "yes"}, "optimizer.params.torch_adam", "true or false"),
    ("Adam", {"torch_adam": True, "bias_correction": True}, "optimizer.params.bias_correction",
     "(torch_adam: true) takes no such argument"),  # DeepSpeed hands it to torch's AdamW, which raises
    ("SGD", {"momentun": 0.9}, "optimizer.params.momentun", "Did you mean 'momentum'"),
    ("SGD", {"momentum": -0.5}, "optimizer.params.momentum", ">= 0.0"),
    ("SGD", {"nesterov": True}, "optimizer.params", "Nesterov"),
])
def test_errors_name_the_key(type_, kw, path, fragment):
    with pytest.raises(ConfigError) as info:
        build(type_, **kw)
    assert info.value.path == path and fragment in str(info.value), str(info.value)


def test_what_deepspeed_accepts_and_torch_cannot_tell_apart_is_accepted():
    g = group(build("Adam", bias_correction=True, set_grad_none=False, amsgrad=False, torch_adam=False))
    assert "bias_correction" not in g and "set_grad_none" not in g and g["amsgrad"] is False
    assert group(build("Adam", torch_adam=True, amsgrad=True))["amsgrad"] is True


# --- the optimizer blocks of real configs ---------------------------------------------------------------------

CONFIG_DIR = Path(__file__).parent / "config" / "ds_configs"
REJECTED = {"18", "35"}  # DeepSpeed itself rejects these two files
_AUTO = "optimizer.params.lr"
# file -> the ConfigError path, or (class, lr, betas, eps, weight_decay) of the optimizer built.
REAL_OPTIMIZERS = {
    "01": _AUTO, "02": _AUTO, "03": _AUTO, "04": _AUTO, "12": _AUTO, "14": _AUTO, "15": _AUTO, "28": _AUTO,
    "20": "optimizer.type", "21": "optimizer.type", "22": "optimizer.type", "37": "optimizer.type",
    "32": "optimizer.params.bias_correction", "38": "optimizer.params.max_grad_norm",
    "17": (torch.optim.AdamW, 4e-5, (0.9, 0.999), 1e-8, 0.0),
    "23": (torch.optim.AdamW, 1e-3, (0.8, 0.999), 1e-8, 3e-7),
    "24": (torch.optim.AdamW, 1e-3, (0.8, 0.999), 1e-8, 3e-7),
    "25": (torch.optim.AdamW, 1e-4, (0.8, 0.999), 1e-8, 3e-7),
    "27": (torch.optim.AdamW, 1e-4, (0.9, 0.999), 1e-8, 0.01),
    "29": (torch.optim.AdamW, 1e-4, (0.9, 0.999), 1e-8, 0.0),
    "30": (torch.optim.AdamW, 2e-5, (0.9, 0.999), 1e-8, 0.01),
    "31": (torch.optim.AdamW, 1e-3, (0.8, 0.999), 1e-8, 3e-7),
    "39": (torch.optim.AdamW, 6e-4, (0.9, 0.95), 1e-8, 0.0),
    "40": (torch.optim.AdamW, 9.7e-5, (0.9, 0.95), 1e-8, 0.0),
}
# After resolve_auto with these, the HF files build AdamW with them (12 keeps its own betas and eps).
RESOLVED = dict(hidden_size=64, micro_batch_size=2, learning_rate=3e-4, betas=(0.9, 0.98), eps=1e-6,
                weight_decay=0.05, warmup_steps=10, total_num_steps=100)


def load(number: str):
    (path, ) = CONFIG_DIR.glob(f"{number}_*.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(path)


def describe(opt):
    g = group(opt)
    return type(opt), g["lr"], g["betas"], g["eps"], g["weight_decay"]  # betas a tuple, as torch's own


def test_real_config_table_covers_every_optimizer_block():
    numbers = {p.name[:2] for p in CONFIG_DIR.glob("*.json")} - REJECTED
    assert {n for n in numbers if load(n).optimizer is not None} == set(REAL_OPTIMIZERS)


@pytest.mark.parametrize("number", sorted(REAL_OPTIMIZERS))
def test_real_config_optimizer_blocks(number):
    config, expected = load(number), REAL_OPTIMIZERS[number]
    if isinstance(expected, tuple):
        assert describe(build_optimizer(config.optimizer, params())) == expected
        return
    with pytest.raises(ConfigError) as info:
        build_optimizer(config.optimizer, params())
    assert info.value.path == expected, str(info.value)
    if expected == "optimizer.type":
        assert info.value.value == config.optimizer.type
    if expected == _AUTO:
        opt = build_optimizer(resolve_auto(config, **RESOLVED).optimizer, params())
        want = {"12": (torch.optim.AdamW, 3e-4, (0.9, 0.999), 1e-8, 0.05),
                "04": (torch.optim.AdamW, 3e-4, (0.9, 0.999), 1e-8, 0.05)}  # 04: torch_adam, torch's defaults
        assert describe(opt) == want.get(number, (torch.optim.AdamW, 3e-4, (0.9, 0.98), 1e-6, 0.05))
