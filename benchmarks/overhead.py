"""Per-call overhead of a remat'd call: tiny blocks, where the host's Python is all there is.

A stack of 32 tiny blocks (8x16 input, a 16x16 matmul and a tanh each), one
gradient step per round, every variant interleaved in each round, medians over
the rounds. The per-call overhead of a checkpointing method is its step time
minus the same API's step without checkpointing, divided by the 32 calls. This
is the CPU proxy for the host-bound GPU step (the GPU's kernels are as short as
these). ``determinism_check="none"`` runs alongside, so the difference is what
the determinism check costs per call.

    python -m benchmarks.overhead
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.func as tf
from torch.utils.checkpoint import checkpoint

from funckpt import remat

from ._common import table

BLOCKS = 32


def block(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _stack(call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        for w in ws:
            x = call(w, x)
        return x.sum()

    return loss


def variants() -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (API, one gradient step)."""
    ws = [torch.randn(16, 16) / 4 for _ in range(BLOCKS)]
    leaves = [w.clone().requires_grad_() for w in ws]
    x = torch.randn(8, 16)
    ckpt = lambda w, x: checkpoint(block, w, x, use_reentrant=False)  # noqa: E731
    calls = {
        "no checkpointing": block,
        "torch.utils.checkpoint": ckpt,
        "remat": remat(block),
        'remat, determinism_check="none"': remat(block, determinism_check="none"),
    }
    out: dict[str, tuple[str, Callable[[], object]]] = {}
    for name, call in calls.items():
        loss = _stack(call)
        out[f".backward(), {name}"] = (".backward()", lambda loss=loss: loss(leaves, x).backward())
        if name != "torch.utils.checkpoint":  # refused by torch.func
            out[f"torch.func.grad, {name}"] = ("torch.func.grad", lambda loss=loss: tf.grad(loss)(ws, x))
    return out


def measure(rounds: int = 60) -> dict[str, float]:
    """Median step time per variant, in seconds."""
    steps = variants()
    for _, step in steps.values():
        step()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, (_, step) in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(rounds: int = 60) -> str:
    med = measure(rounds)
    rows = []
    for api in (".backward()", "torch.func.grad"):
        base = med[f"{api}, no checkpointing"]
        for name, t in med.items():
            if not name.startswith(api + ","):
                continue
            per_call = (t - base) / BLOCKS * 1e6
            rows.append([f"`{name}`", f"{t * 1e3:.2f}", f"{per_call:.0f}" if t != base else "-"])
    torch_call = (med[".backward(), torch.utils.checkpoint"] - med[".backward(), no checkpointing"]) / BLOCKS
    ratio = {
        api: (med[f"{api}, remat"] - med[f"{api}, no checkpointing"]) / BLOCKS / torch_call
        for api in (".backward()", "torch.func.grad")
    }
    check = {
        api: (med[f"{api}, remat"] - med[f'{api}, remat, determinism_check="none"']) / BLOCKS * 1e6
        for api in (".backward()", "torch.func.grad")
    }
    return "\n".join(
        [
            "## Per-call overhead (CPU proxy for the host-bound GPU step)",
            "",
            f"Command: `python -m benchmarks.overhead`. {BLOCKS} tiny blocks (`tanh(x @ w)`, 8x16 by 16x16), one",
            f"gradient step per round, all variants interleaved, medians of {rounds} rounds. Per-call overhead:",
            "(step - the same API's step without checkpointing) / 32, in microseconds.",
            "",
            table(["variant", "step (ms)", "overhead per call (us)"], rows),
            "",
            f"remat's per-call overhead is **{ratio['.backward()']:.2f}x** `torch.utils.checkpoint`'s under",
            f"`.backward()` and **{ratio['torch.func.grad']:.2f}x** it under `torch.func.grad` (where torch's",
            "cannot run). The determinism check (a value digest of each output in both runs and their",
            f"comparison) costs {check['.backward()']:.0f} us per call under `.backward()` and",
            f"{check['torch.func.grad']:.0f} us under `torch.func.grad` on this CPU; on an accelerator it adds one",
            "host synchronisation at the end of each backward pass (not measured here: no GPU was available).",
        ]
    )


if __name__ == "__main__":
    print(run())
