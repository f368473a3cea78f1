"""Checkpointed loops: peak memory and time vs the number of steps, and recomputation vs checkpoints.

A loop of ``n`` steps of a small recurrent cell (carry 64 x 128, float32: 32 KiB;
a step ``tanh(c @ W + x)`` then a residual MLP, about six carry-sizes of
internals). Differentiated with ``.backward()`` through:

* the plain Python loop (every step's internals kept),
* a Python loop of ``funckpt.remat(step)`` calls (per-step remat: every carry kept),
* ``funckpt.scan(..., checkpoints=None)`` (every carry kept, one region),
* ``funckpt.scan(..., checkpoints=c)`` with ``c = 8`` and ``c = ceil(log2 n)``.

Peak memory from the profiler (in carry-sizes), time per step (forward and
backward, median of a few runs). Then, for ``n = 1000``, the steps run again in
the backward pass as ``c`` varies, counted by the step itself, next to Griewank
and Walther's optimum for the schedule.

    python -m benchmarks.loops --write    # n = 10 .. 10,000, into BENCHMARKS.md (ten minutes or so on 2 cores)
    python -m benchmarks.loops --small    # a smoke run
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import funckpt
from funckpt import _schedule

from ._common import median_seconds, peak_bytes, table, write_block

BATCH, WIDTH = 64, 128
CARRY = BATCH * WIDTH * 4
PLOT = Path(__file__).resolve().parent / "loops.png"
STEPS = (10, 100, 1000, 10_000)
SMALL_STEPS = (5, 10)
SWEEP_N = 1000
PER_STEP_UP_TO = 1000
SWEEP_C = (2, 3, 4, 6, 8, 12, 16, 32, 64, 1000)


class Cell:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5).requires_grad_()
        self.w1 = (torch.randn(WIDTH, 2 * WIDTH, generator=g) / WIDTH**0.5).requires_grad_()
        self.w2 = (torch.randn(2 * WIDTH, WIDTH, generator=g) / (2 * WIDTH) ** 0.5).requires_grad_()
        self.calls = 0

    def __call__(self, c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.calls += 1
        h = torch.tanh(c @ self.w + x)
        return h + 0.1 * torch.relu(h @ self.w1) @ self.w2, None

    def params(self) -> list[torch.Tensor]:
        return [self.w, self.w1, self.w2]


def variants(n: int) -> dict[str, Callable[[Cell, torch.Tensor, torch.Tensor], torch.Tensor]]:
    log_c = max(1, math.ceil(math.log2(n)))

    def plain(cell: Cell, c: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            c, _ = cell(c, xs[i])
        return c

    def per_step(cell: Cell, c: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        step = funckpt.remat(cell)
        for i in range(n):
            c, _ = step(c, xs[i])
        return c

    def scanned(checkpoints: int | None) -> Callable[[Cell, torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda cell, c, xs: funckpt.scan(cell, c, xs, checkpoints=checkpoints)[0]

    return {
        "plain Python loop": plain,
        "Python loop of remat(step)": per_step,
        "scan, checkpoints=None": scanned(None),
        "scan, checkpoints=8": scanned(8),
        "scan, checkpoints=ceil(log2 n)": scanned(log_c),
    }


def measure(n: int, timing: bool = True) -> dict[str, tuple[float, float]]:
    cell = Cell()
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, BATCH, WIDTH, generator=g)
    c0 = torch.randn(BATCH, WIDTH, generator=g, requires_grad=True)

    def clear() -> None:
        for p in (*cell.params(), c0):
            p.grad = None

    out = {}
    for name, loop in variants(n).items():
        if name == "Python loop of remat(step)" and n > PER_STEP_UP_TO:
            out[name] = (math.nan, math.nan)  # profiling 10,000 remat'd calls takes most of an hour here
            continue

        def step(loop: Any = loop) -> object:
            loop(cell, c0, xs).square().mean().backward()
            return [p.grad for p in cell.params()]

        step()
        peak = peak_bytes(step, setup=clear) / CARRY
        seconds = median_seconds(step, repeats=3 if n < 1000 else 1, warmup=0) if timing else math.nan
        out[name] = (peak, seconds / n * 1e6)
    return out


def recomputation(n: int, checkpoints: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """Steps run in the backward pass beyond the n reversals: measured, and the schedule's optimum."""
    cell = Cell()
    xs = torch.randn(n, BATCH, WIDTH)
    c0 = torch.randn(BATCH, WIDTH, requires_grad=True)
    out = {}
    for c in checkpoints:
        cell.calls = 0
        carry, _ = funckpt.scan(cell, c0, xs, checkpoints=c)
        forward = cell.calls
        carry.sum().backward()
        extra = cell.calls - forward - n
        # the forward pass runs the n steps, and the backward pass starts from the carry after the
        # last: the optimum of n + 1 steps whose last reversal is free, less the forward pass's n
        optimum = _schedule.binomial_advances(n + 1, c) - n
        out[c] = (extra, optimum)
    return out


def plot(results: dict[int, dict[str, tuple[float, float]]], sweep: dict[int, tuple[int, int]], steps: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in results[steps[0]]:
        points = [(n, results[n][name][0]) for n in steps if not math.isnan(results[n][name][0])]
        left.plot([n for n, _ in points], [v for _, v in points], marker="o", label=name)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("steps n")
    left.set_ylabel("peak memory (carry-sizes)")
    left.set_title("peak memory vs steps (.backward())")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)
    cs = sorted(sweep)
    right.plot(cs, [sweep[c][0] / SWEEP_N for c in cs], marker="o", label="measured")
    right.plot(cs, [sweep[c][1] / SWEEP_N for c in cs], linestyle="--", label="optimum (Griewank-Walther)")
    right.set_xscale("log")
    right.set_xlabel("checkpoints c")
    right.set_ylabel(f"extra steps run per step (n = {SWEEP_N})")
    right.set_title("recomputation vs checkpoints")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)


def _cell(value: float, spec: str) -> str:
    return "—" if math.isnan(value) else format(value, spec)


def run(small: bool = False) -> str:
    steps = SMALL_STEPS if small else STEPS
    results = {n: measure(n, timing=not small) for n in steps}
    sweep = recomputation(30 if small else SWEEP_N, (2, 8) if small else SWEEP_C)
    if not small:
        plot(results, sweep, steps)
    names = list(results[steps[0]])
    memory_rows = [[f"`{name}`"] + [_cell(results[n][name][0], ".1f") for n in steps] for name in names]
    time_rows = [[f"`{name}`"] + [_cell(results[n][name][1], ".0f") for n in steps] for name in names]
    sweep_rows = [[c, extra, optimum, f"{extra / max(optimum, 1):.2f}"] for c, (extra, optimum) in sorted(sweep.items())]
    largest = steps[-1]
    plain_peak = results[largest]["plain Python loop"][0]
    log_peak = results[largest]["scan, checkpoints=ceil(log2 n)"][0]
    return "\n".join(
        [
            "## Checkpointed loops: memory and time vs steps, recomputation vs checkpoints",
            "",
            "Command: `python -m benchmarks.loops --write` (ten minutes or so, so not part of `python -m benchmarks.run`,",
            "which keeps this section). A recurrent cell",
            f"(carry {BATCH} x {WIDTH} float32 = 1 carry-size, {CARRY // 1024} KiB; `tanh(c @ W + x)` and a residual MLP), `.backward()`",
            "through n steps. CPU figures: a proxy for memory (exact byte counts) and for host overhead.",
            "",
            f"Peak memory (carry-sizes, parameter gradients included; per-step remat is not profiled beyond n = {PER_STEP_UP_TO}):",
            "",
            table(["variant"] + [f"n = {n}" for n in steps], memory_rows),
            "",
            "Time per step, forward and backward (us):",
            "",
            table(["variant"] + [f"n = {n}" for n in steps], time_rows),
            "",
            f"At n = {largest}: scan with ceil(log2 n) checkpoints peaks at {log_peak:.0f} carry-sizes, the plain loop at",
            f"{plain_peak:.0f} ({plain_peak / log_peak:.0f}x).",
            "",
            f"Steps run again in the backward pass beyond the n reversals, n = {30 if small else SWEEP_N}:",
            "measured, and Griewank and Walther's optimum for the same number of checkpoints (of",
            "n + 1 steps whose last reversal is free: the forward pass runs the n steps, and the",
            "backward pass starts from the carry after the last):",
            "",
            table(["checkpoints", "measured", "optimum", "ratio"], sweep_rows),
            "",
            "![memory vs steps, recomputation vs checkpoints](benchmarks/loops.png)",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--write", action="store_true", help="also put the section into BENCHMARKS.md")
    args = parser.parse_args()
    section = run(small=args.small)
    print(section)
    if args.write and not args.small:
        write_block("python -m benchmarks.loops --write", section)
