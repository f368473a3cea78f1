"""The per-call cost of RNG capture and replay (issue: randomness).

A tiny remat'd function (a 16x16 matmul, tanh, dropout), forward and backward,
with ``preserve_rng_state`` on and off, interleaved over many rounds; the
difference of the medians is what capturing the CPU generator's state in the
forward run and replaying it around the recomputation costs per call.
``torch.utils.checkpoint`` runs alongside for reference.

    python -m benchmarks.rng
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from funckpt import remat

from ._common import table


def tiny(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(torch.tanh(x @ w), 0.1)


def run(rounds: int = 400) -> str:
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    variants = {
        "remat, preserve_rng_state=True": remat(tiny),
        "remat, preserve_rng_state=False": remat(tiny, preserve_rng_state=False),
        "torch.utils.checkpoint, preserve_rng_state=True": lambda w, x: checkpoint(tiny, w, x, use_reentrant=False),
        "torch.utils.checkpoint, preserve_rng_state=False": lambda w, x: checkpoint(
            tiny, w, x, use_reentrant=False, preserve_rng_state=False
        ),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds // 10):
        for fn in variants.values():
            fn(w, x).sum().backward()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(w, x).sum().backward()
            samples[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    rows = [[f"`{k}`", f"{v:.0f}"] for k, v in med.items()]
    cost = med["remat, preserve_rng_state=True"] - med["remat, preserve_rng_state=False"]
    state = torch.get_rng_state().numel()
    return "\n".join(
        [
            "## RNG capture: cost per call",
            "",
            "Command: `python -m benchmarks.rng`. A tiny function (16x16 matmul, tanh, dropout), forward and",
            f"backward through `.backward()`, median of {rounds} interleaved rounds, in microseconds per call.",
            "",
            table(["variant", "forward + backward (us)"], rows),
            "",
            f"RNG capture and replay cost **{cost:.0f} us per remat'd call** here (CPU only: no accelerator",
            f"generators to save), and {state / 1024:.1f} KiB of memory per call for the saved CPU state,",
            "kept until the backward pass. For the 18 ms blocks of the core benchmark that is under 0.5%.",
        ]
    )


if __name__ == "__main__":
    print(run())
