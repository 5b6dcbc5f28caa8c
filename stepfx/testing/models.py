"""Small reference models in plain PyTorch, for tests, examples and benchmarks.

``GPT`` is the standard workload of BENCHMARKS.md: pre-LayerNorm blocks,
causal ``F.scaled_dot_product_attention``, GELU(tanh) MLP 4x, learned
positions, tied input/output embeddings. ``gpt_1_3b()``/``gpt_350m()``
give the benchmark sizes; tests use tiny configurations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "gpt_config", "MLP", "SmallCNN", "lm_loss"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    seq_len: int = 2048
    d_model: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    dropout: float = 0.0
    bias: bool = True


def gpt_config(name: str, **overrides) -> GPTConfig:
    """The sizes BENCHMARKS.md names: "350M", "1.3B", "6.6B", "13B"; "tiny" for tests."""
    sizes = {
        "tiny": dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4),
        "small": dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4),
        "350M": dict(d_model=1024, n_layers=24, n_heads=16),
        "1.3B": dict(d_model=2048, n_layers=24, n_heads=16),
        "6.6B": dict(d_model=4096, n_layers=32, n_heads=32),
        "13B": dict(d_model=5120, n_layers=40, n_heads=40),  # 12.9B: issue 18's largest-model run
    }
    if name not in sizes:
        raise ValueError(f"unknown GPT size {name!r}; known: {', '.join(sizes)}")
    return GPTConfig(**{**sizes[name], **overrides})


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(d, bias=cfg.bias)
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.bias)
        self.proj = nn.Linear(d, d, bias=cfg.bias)
        self.ln2 = nn.LayerNorm(d, bias=cfg.bias)
        self.fc = nn.Linear(d, 4 * d, bias=cfg.bias)
        self.fc_out = nn.Linear(4 * d, d, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        x = x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        # counted now: ZeRO-3 empties the module's parameters once their pieces exist (stepfx's binding)
        self._matmul_params = sum(p.numel() for n, p in self.named_parameters() if not n.startswith("pos."))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def matmul_params(self) -> int:
        """Parameters that do matmuls (BENCHMARKS.md's N): the position
        embedding excluded; the token embedding is the tied head's weight,
        which does a matmul, counted once. As built: a ZeRO-3 step empties
        the module's parameters (their pieces are the rank's), and the
        benchmarks ask after their steps."""
        return self._matmul_params


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class MLP(nn.Module):
    def __init__(self, sizes=(8, 16, 4), activation: type[nn.Module] = nn.GELU, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b, bias=bias))
            if i < len(sizes) - 2:
                layers.append(activation())
                if dropout:
                    layers.append(nn.Dropout(dropout))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv + BatchNorm (running statistics are buffers the step updates)."""

    def __init__(self, channels: int = 4, classes: int = 5):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))
