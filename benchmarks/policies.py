"""Saving policies on the MLP stack, and the per-operator cost of the policy machinery.

Part 1: one ``.backward()`` step of the 8-block stack of the core benchmark,
per block ``remat`` with each policy, beside no remat: peak memory, median step
time, and a plot of the trade-off (``benchmarks/policies.png``).

Part 2: a remat'd region of 200 tiny elementwise operators with a policy that
is consulted on every operator and keeps nothing, against
``torch.utils.checkpoint`` with a selective-checkpointing policy doing the same.

    python -m benchmarks.policies
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.func as tf
import torch.utils.checkpoint as upstream

from funckpt import policies, remat

from ._common import peak_bytes, table
from .core import ACTIVATION, Variant, peaks, stack_inputs, step_times
from .mlp_stack import loss_fn, named_block

PLOT = Path(__file__).resolve().parent / "policies.png"

POLICIES: dict[str, Any] = {
    "nothing_saveable (default)": policies.nothing_saveable,
    "save_only_these_names('up')": policies.save_only_these_names("up"),
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": policies.dots_saveable,
    "everything_saveable": policies.everything_saveable,
}


def stack_variants() -> list[Variant]:
    params, x, leaves, clear = stack_inputs(8)

    def step(block_fn: Any) -> Any:
        def run() -> Any:
            loss_fn(leaves, x, block_fn).backward()
            return [v.grad for p in leaves for v in p.values()]

        return run

    variants = [Variant("no remat", step(named_block), clear)]
    variants += [Variant(name, step(remat(named_block, policy=p)), clear) for name, p in POLICIES.items()]
    return variants


def func_grad_peaks() -> dict[str, float]:
    params, x, _, _ = stack_inputs(8)
    out = {"no remat": peak_bytes(lambda: tf.grad(loss_fn)(params, x, named_block)) / ACTIVATION}
    for name, p in POLICIES.items():
        block = remat(named_block, policy=p)
        out[name] = peak_bytes(lambda: tf.grad(loss_fn)(params, x, block)) / ACTIVATION
    return out


def plot(peak: dict[str, float], times: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [times[n] * 1e3 for n in peak]
    ys = list(peak.values())
    near_x, near_y = 0.04 * (max(xs) - min(xs) or 1), 0.04 * (max(ys) - min(ys) or 1)
    placed: list[tuple[float, float]] = []
    for name, x, y in zip(peak, xs, ys):
        ax.scatter(x, y, s=40)
        # Points that (nearly) coincide get their labels stacked, not overprinted.
        below = sum(abs(x - px) < near_x and abs(y - py) < near_y for px, py in placed)
        placed.append((x, y))
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4 - 11 * below), fontsize=8)
    ax.set_xlabel("median step time (ms), .backward()")
    ax.set_ylabel("peak memory (activation-sizes)")
    ax.set_title("funckpt policies: memory vs time, 8-block MLP stack")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)


def tiny_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(100):
        x = x * 1.001
        x = x + 0.001
    return x


def per_op_section(rounds: int = 60) -> str:
    import statistics
    import time

    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return upstream.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else upstream.CheckpointPolicy.PREFER_RECOMPUTE

    sac = functools.partial(upstream.create_selective_checkpoint_contexts, torch_policy)
    variants = {
        "remat, policy=dots_saveable (consulted 200 times)": remat(tiny_chain, policy=policies.dots_saveable),
        "torch.utils.checkpoint + selective policy": lambda x: upstream.checkpoint(
            tiny_chain, x, use_reentrant=False, context_fn=sac
        ),
        "remat, no policy": remat(tiny_chain),
        "torch.utils.checkpoint, no policy": lambda x: upstream.checkpoint(tiny_chain, x, use_reentrant=False),
    }
    x = torch.randn(16, requires_grad=True)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn(x).sum().backward()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn(x).sum().backward()
            samples[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    ratio = med["remat, policy=dots_saveable (consulted 200 times)"] / med["torch.utils.checkpoint + selective policy"]
    rows = [[f"`{k}`", f"{v:.2f}"] for k, v in med.items()]
    return "\n".join(
        [
            "### Per-operator cost of the policy machinery",
            "",
            f"A remat'd region of 200 tiny elementwise operators on 16 floats, forward and backward, median of {rounds}",
            "interleaved rounds (ms). The policy is consulted on every operator and keeps nothing.",
            "",
            table(["variant", "forward + backward (ms)"], rows),
            "",
            f"- remat with a policy / torch.utils.checkpoint with a selective policy: **{ratio:.2f}** "
            f"(target <= 2.00: {'met' if ratio <= 2 else 'NOT met'})",
        ]
    )


def run(rounds: int = 15) -> str:
    variants = stack_variants()
    peak = peaks(variants)
    times = step_times(variants, rounds)
    grad_peak = func_grad_peaks()
    plot(peak, times)
    base = "no remat"
    rows = [
        [
            f"`{name}`",
            f"{peak[name]:.1f}",
            f"{peak[name] / peak[base]:.2f}",
            f"{grad_peak[name]:.1f}",
            f"{times[name] * 1e3:.0f}",
            f"{times[name] / times[base]:.2f}",
        ]
        for name in peak
    ]
    dots_time = times["dots_saveable"] / times[base]
    between = peak["nothing_saveable (default)"] < peak["dots_saveable"] < peak[base]
    return "\n".join(
        [
            "## Saving policies (8 blocks, batch 512, width 256)",
            "",
            "Command: `python -m benchmarks.policies` (part of `python -m benchmarks.run`). Per-block remat with",
            "each policy on the core benchmark's stack (the block names its first matmul's result `up`). Peak",
            "memory in activation-sizes, including the 32 of parameter gradients; step time: median of",
            f"{rounds} interleaved rounds.",
            "",
            table(
                [
                    "policy",
                    "peak, .backward() (act.)",
                    "peak / no remat",
                    "peak, torch.func.grad (act.)",
                    "step, .backward() (ms)",
                    "time / no remat",
                ],
                rows,
            ),
            "",
            "![memory vs time for each policy](benchmarks/policies.png)",
            "",
            "Targets:",
            "",
            f"- `dots_saveable` step time <= 1.10x no remat: **{dots_time:.2f}**, {'met' if dots_time <= 1.10 else 'NOT met'}",
            f"- `dots_saveable` peak strictly between `nothing_saveable` and no remat: "
            f"{peak['nothing_saveable (default)']:.1f} < {peak['dots_saveable']:.1f} < {peak[base]:.1f}: "
            f"{'met' if between else 'NOT met'}",
            "- `dots_saveable` recomputes zero matrix multiplies: checked by operator counts in "
            "`tests/test_policies.py::test_dots_saveable_recomputes_no_matmul`.",
            "",
            "Why the `dots_saveable` step-time target is not met. No matmul is recomputed (the operator",
            "counts prove it), so what remains is funckpt's per-call machinery rather than recomputation: the",
            "forward run records a local autograd graph and runs under a torch-function mode and the policy's",
            "dispatch mode, and the backward rebuilds the graph from the kept values through a second autograd",
            "pass. Timing one block's forward and backward separately shows overhead on both sides, larger than",
            "the elementwise work recomputed. Closing the gap means moving the per-operator bookkeeping out of",
            "Python; the per-operator figures below show its cost.",
            "",
            per_op_section(),
        ]
    )


if __name__ == "__main__":
    print(run())
