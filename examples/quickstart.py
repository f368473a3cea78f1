"""Quickstart: remat under torch.func.grad, where torch.utils.checkpoint cannot go.

Trains nothing; computes one gradient of an 8-block MLP stack three ways and
shows that remat gives the same gradients as plain torch.func.grad while
keeping a fraction of the memory.

    python examples/quickstart.py
"""

import sys
from pathlib import Path

import torch
import torch.func as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import peak_bytes  # noqa: E402
from benchmarks.mlp_stack import block, init_params, loss_fn  # noqa: E402

from funckpt import remat  # noqa: E402


def main(depth: int = 8, width: int = 256, batch: int = 512) -> None:
    params = init_params(depth=depth, width=width)
    x = torch.randn(batch, width)
    activation = x.numel() * x.element_size()

    plain = tf.grad(loss_fn)(params, x)
    rematted = tf.grad(loss_fn)(params, x, remat(block))
    torch.testing.assert_close(rematted, plain)
    print("gradients with remat equal torch.func.grad's: yes")

    try:
        from torch.utils.checkpoint import checkpoint

        tf.grad(loss_fn)(params, x, lambda p, h: checkpoint(block, p, h, use_reentrant=False))
        print("torch.utils.checkpoint under torch.func.grad: works")
    except Exception as e:  # it raises: saved tensor hooks are refused by torch.func
        print(f"torch.utils.checkpoint under torch.func.grad: fails ({type(e).__name__})")

    plain_peak = peak_bytes(lambda: tf.grad(loss_fn)(params, x))
    remat_peak = peak_bytes(lambda: tf.grad(loss_fn)(params, x, remat(block)))
    print(f"peak memory, torch.func.grad:              {plain_peak / activation:6.1f} activation-sizes")
    print(f"peak memory, torch.func.grad + remat:      {remat_peak / activation:6.1f} activation-sizes")
    print(f"remat keeps {remat_peak / plain_peak:.2f}x the memory (gradients included)")


if __name__ == "__main__":
    main()
