"""Per-example gradients through a remat'd network: where torch.utils.checkpoint cannot go.

``torch.func.vmap(torch.func.grad(loss))`` computes one gradient per example.
``torch.utils.checkpoint`` raises under it (torch.func refuses its saved-tensor
hooks); ``funckpt.remat`` works, gives the same gradients, and keeps a fraction
of the memory.

    python examples/per_example_grads.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.func as tf
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import peak_bytes  # noqa: E402

from funckpt import remat  # noqa: E402


def block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ p["up"]) @ p["down"]


def make_loss(block_fn):
    def loss(params, x, y):
        for p in params:
            x = block_fn(p, x)
        return (x.sum(-1) - y).square().mean()

    return loss


def main(depth: int = 8, width: int = 64, examples: int = 32, length: int = 256) -> None:
    g = torch.Generator().manual_seed(0)
    params = [
        {"up": torch.randn(width, 4 * width, generator=g) / width**0.5, "down": torch.randn(4 * width, width, generator=g) / (4 * width) ** 0.5}
        for _ in range(depth)
    ]
    xs = torch.randn(examples, length, width, generator=g)  # one sequence per example
    ys = torch.randn(examples, length, generator=g)

    def per_example(block_fn):
        return tf.vmap(tf.grad(make_loss(block_fn)), in_dims=(None, 0, 0))(params, xs, ys)

    from torch.utils.checkpoint import checkpoint

    try:
        per_example(lambda p, x: checkpoint(block, p, x, use_reentrant=False))
        print("torch.utils.checkpoint under vmap(grad(...)): works")
    except RuntimeError as e:
        print(f"torch.utils.checkpoint under vmap(grad(...)): fails: {str(e).splitlines()[0][:90]}")

    expected = per_example(block)
    got = per_example(remat(block))
    torch.testing.assert_close(got, expected)
    print(f"per-example gradients with remat equal the plain ones: yes ({examples} examples, {depth} blocks)")
    plain = peak_bytes(lambda: per_example(block))
    rematted = peak_bytes(lambda: per_example(remat(block)))
    print(f"peak memory: {plain / 2**20:.1f} MiB plain, {rematted / 2**20:.1f} MiB with remat ({rematted / plain:.2f}x)")


if __name__ == "__main__":
    main()
