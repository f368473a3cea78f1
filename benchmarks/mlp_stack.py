"""The benchmark model: a stack of pre-norm MLP residual blocks, written functionally.

``block(p, x) = x + gelu(layer_norm(x) @ w1 + b1) @ w2 + b2`` with width ``d``
and hidden width ``4 d``. Parameters are a list of dicts of plain tensors, the
way ``torch.func`` users keep them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from funckpt import checkpoint_name


def init_params(depth: int, width: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    hidden = 4 * width

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype) / shape[0] ** 0.5

    return [
        {
            "ln_w": torch.ones(width, dtype=dtype),
            "ln_b": torch.zeros(width, dtype=dtype),
            "w1": rand(width, hidden),
            "b1": torch.zeros(hidden, dtype=dtype),
            "w2": rand(hidden, width),
            "b2": torch.zeros(width, dtype=dtype),
        }
        for _ in range(depth)
    ]


def block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    return x + F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def named_block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``block`` with its first matmul's result named ``"up"`` for name-based policies."""
    h = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    up = checkpoint_name(h @ p["w1"], "up")
    return x + F.gelu(up + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(params: list[dict[str, torch.Tensor]], x: torch.Tensor, block_fn=block) -> torch.Tensor:
    for p in params:
        x = block_fn(p, x)
    return x.square().mean()
