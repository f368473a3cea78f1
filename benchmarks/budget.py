"""memory_budget and offloading: peak memory against step time, budgets as a curve, fixed policies as points.

    python -m benchmarks.budget            # CPU proxy: the 8-block MLP stack of the core benchmark
    python -m benchmarks.budget --write    # ... and put that section into BENCHMARKS.md
    python -m benchmarks.budget --gpu      # CUDA: the GPT-style stack of benchmarks.gpu (12 blocks, bf16)
    python -m benchmarks.budget --small    # the GPU section's code on a tiny configuration on the CPU (smoke)

One ``.backward()`` step, per block ``remat`` with each policy, every variant in
the same process, step times interleaved round by round (medians). The
budgets are ``memory_budget(f)`` for ``f`` in :data:`FRACTIONS`; the fixed
policies are ``nothing_saveable``, ``dots_with_no_batch_dims_saveable``,
``dots_saveable``, ``everything_saveable`` and
``offload_dot_with_no_batch_dims()``. "Dominated or matched": some budget has
a peak and a step time each at most ``TOLERANCE`` above the fixed policy's.

On a CPU there is no device memory to offload from: ``offload_dot_with_no_batch_dims``
keeps the dots as ``dots_with_no_batch_dims_saveable`` does (a CPU tensor is
simply kept), so only the GPU section measures offloading. CPU peaks are the
profiler's (``_common.peak_bytes``); GPU peaks are
``torch.cuda.max_memory_allocated()`` during the step minus what was
allocated before it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import funckpt
from funckpt import policies, remat

from ._common import peak_bytes, table, write_block
from .core import Variant, peaks, stack_inputs, step_times
from .mlp_stack import block, loss_fn

PLOT = Path(__file__).resolve().parent / "budget.png"
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TOLERANCE = 0.05

FIXED: dict[str, Any] = {
    "nothing_saveable": policies.nothing_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": policies.dots_saveable,
    "everything_saveable": policies.everything_saveable,
    "offload_dot_with_no_batch_dims()": policies.offload_dot_with_no_batch_dims(),
}


def budget_name(f: float) -> str:
    return f"memory_budget({f:g})"


def all_policies(share: float | None = None) -> dict[str, Any]:
    """The fixed policies, the budgets of FRACTIONS, and (if given) the budget at dots' share."""
    out = {**FIXED, **{budget_name(f): policies.memory_budget(f) for f in FRACTIONS}}
    if share is not None:
        out[share_name(share)] = policies.memory_budget(share)
    return out


def share_name(share: float) -> str:
    return f"memory_budget({share:.4g}), dots' share"


def dots_share(fn: Callable[..., Any], *args: Any) -> float:
    """The bytes dots_saveable keeps in one call of ``fn``, as a fraction of everything_saveable's."""

    def kept(policy: Any) -> int:
        rs = funckpt.saved_residuals(remat(fn, policy=policy), *args)
        return sum(r.nbytes for r in rs if r.kind == "saved by policy")

    return kept(policies.dots_saveable) / kept(policies.everything_saveable)


# ------------------------------------------------------------------ analysis


def dominance(points: dict[str, tuple[float, float]]) -> dict[str, str | None]:
    """For each fixed policy: the first budget whose (peak, time) is within TOLERANCE of or below it."""
    out: dict[str, str | None] = {}
    for name in FIXED:
        peak, t = points[name]
        out[name] = next(
            (
                budget_name(f)
                for f in FRACTIONS
                if points[budget_name(f)][0] <= peak * (1 + TOLERANCE) and points[budget_name(f)][1] <= t * (1 + TOLERANCE)
            ),
            None,
        )
    return out


def plot(
    points: dict[str, tuple[float, float]], title: str, ylabel: str, xlabel: str, path: Path = PLOT
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    curve = [points[budget_name(f)] for f in FRACTIONS]
    ax.plot([t * 1e3 for _, t in curve], [p for p, _ in curve], "o-", color="tab:blue", label="memory_budget(f)")
    for f, (p, t) in zip(FRACTIONS, curve):
        ax.annotate(f"{f:g}", (t * 1e3, p), textcoords="offset points", xytext=(5, -10), fontsize=8, color="tab:blue")
    markers = iter("s^Dvx*P")
    for name in FIXED:
        p, t = points[name]
        ax.scatter([t * 1e3], [p], marker=next(markers), s=55, label=name, zorder=3)
    for name, (p, t) in points.items():
        if name.endswith("dots' share"):
            ax.scatter([t * 1e3], [p], marker="o", color="tab:cyan", s=40, label=name, zorder=3)
        elif name not in FIXED and not name.startswith("memory_budget"):
            ax.scatter([t * 1e3], [p], marker="o", facecolors="none", edgecolors="gray", s=55, label=name, zorder=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rows(points: dict[str, tuple[float, float]], unit: str) -> list[list[str]]:
    return [[f"`{name}`", f"{p:.1f}", f"{t * 1e3:.0f}" if t >= 0.01 else f"{t * 1e3:.2f}"] for name, (p, t) in points.items()]


def _verdicts(points: dict[str, tuple[float, float]]) -> list[str]:
    lines = []
    for name, by in dominance(points).items():
        p, t = points[name]
        if by is None:
            lines.append(f"- `{name}` ({p:.1f}, {t * 1e3:.0f} ms): **not** dominated or matched by any of the 5 budgets")
        else:
            bp, bt = points[by]
            lines.append(f"- `{name}` ({p:.1f}, {t * 1e3:.0f} ms): matched or dominated by `{by}` ({bp:.1f}, {bt * 1e3:.0f} ms)")
    return lines


def _noise(points: dict[str, tuple[float, float]]) -> list[str]:
    """memory_budget(0) and (1) are nothing_saveable and everything_saveable: their time gaps are noise."""
    gaps = [
        abs(points[budget_name(f)][1] / points[fixed][1] - 1)
        for f, fixed in ((0.0, "nothing_saveable"), (1.0, "everything_saveable"))
    ]
    return [
        "How to read the times: `memory_budget(0)` and `memory_budget(1)` are the `nothing_saveable` and",
        f"`everything_saveable` policies themselves, so their gaps ({gaps[0]:.0%} and {gaps[1]:.0%} here) measure the",
        "noise of this machine; time differences of that size between other rows mean nothing either.",
    ]


# ------------------------------------------------------------------ CPU: the MLP stack


def cpu_points(rounds: int) -> dict[str, tuple[float, float]]:
    params, x, leaves, clear = stack_inputs(8)
    share = dots_share(block, params[0], x)

    def step(block_fn: Any) -> Callable[[], Any]:
        def run() -> Any:
            loss_fn(leaves, x, block_fn).backward()
            return [v.grad for p in leaves for v in p.values()]

        return run

    variants = [Variant("no remat", step(block), clear)]
    variants += [Variant(name, step(remat(block, policy=p)), clear) for name, p in all_policies(share).items()]
    peak = peaks(variants)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = cpu_seconds(variants, rounds)
    finally:
        torch.set_num_threads(threads)
    return {name: (peak[name], times[name]) for name in peak}


def cpu_seconds(vs: list[Variant], rounds: int) -> dict[str, float]:
    """Least CPU seconds of this process per step, on one torch thread, rounds interleaved.

    CPU time rather than wall time, and the least rather than the median: on a shared machine
    other processes' load inflates both (caches, clock), by up to ~10% for the median here,
    and the least is the sample they disturbed least.
    """
    return step_times(vs, rounds, clock=time.process_time, summary=min)


def run(rounds: int = 9) -> str:
    """The CPU section of BENCHMARKS.md (a CPU proxy of the GPU benchmark)."""
    points = cpu_points(rounds)
    plot(
        points,
        "memory_budget against fixed policies, 8-block MLP stack (CPU)",
        "peak memory (activation-sizes)",
        "step CPU time (ms, least of the rounds), .backward(), 1 thread",
    )
    lines = [
        "## memory_budget and offloading (CPU proxy; 8 blocks, batch 512, width 256)",
        "",
        "Command: `python -m benchmarks.budget --write` (about a minute, so not part of `python -m benchmarks.run`,",
        "which keeps this block as it is). The core benchmark's",
        "stack, one `.backward()` step, per-block remat with each policy; peak memory in activation-sizes",
        f"(including the 32 of parameter gradients); step time: the least CPU time of the process over {rounds}",
        "interleaved rounds on one torch thread (CPU time, and the least, because the machine was shared). This is",
        "a CPU proxy: on a CPU `offload_dot_with_no_batch_dims()` simply keeps its values (there is no device",
        "memory to offload from), so it is `dots_with_no_batch_dims_saveable` plus the offload bookkeeping.",
        "",
        table(["policy", "peak (act.)", "step CPU time (ms)"], _rows(points, "act.")),
        "",
        "![peak memory against step time, budgets and fixed policies](benchmarks/budget.png)",
        "",
        f"Each fixed policy against the 5 budgets {', '.join(f'{f:g}' for f in FRACTIONS)} (matched: peak and time each "
        f"within {TOLERANCE:.0%}; the dots' share row is not one of the 5):",
        "",
        *_verdicts(points),
        "",
        "Why the dots policies are not matched by these 5: a budget keeps a prefix of one ranking (by",
        "estimated FLOPs per byte), so that more budget never keeps less. On this block the two matmuls lead",
        "it, and they are the dots policies' whole choice, at about 31% of the candidates' bytes; 0.25 stops",
        "before the second one and 0.5 adds the next value after them (a residual add). The budget at the",
        "dots' share (last row, not one of the 5) keeps exactly the dots and matches them.",
        "",
        *_noise(points),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ GPU: the GPT-style stack


def gpu_points(config: Any, device: torch.device, rounds: int) -> dict[str, tuple[float, float]]:
    """(peak MiB, median step seconds) per policy, ``.backward()`` on the GPT-style stack."""
    from .gpu import Block, measure_steps

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(config.d, config.heads) for _ in range(config.blocks)).to(device, config.dtype)
    x = torch.randn(config.b, config.t, config.d, device=device, dtype=config.dtype)

    def make(policy: Any) -> Callable[[], None]:
        layers = [remat(b, policy=policy) for b in blocks] if policy is not None else list(blocks)

        def step() -> None:
            blocks.zero_grad(set_to_none=True)
            h = x
            for layer in layers:
                h = layer(h)
            h.float().pow(2).mean().backward()

        return step

    share = dots_share(blocks[0], x)
    steps = {"no remat": make(None), **{name: make(p) for name, p in all_policies(share).items()}}
    def clear() -> None:
        blocks.zero_grad(set_to_none=True)

    measured = measure_steps(steps, device, rounds, setup=clear)
    if device.type == "cuda":
        return {k: (peak, seconds) for k, (seconds, peak) in measured.items()}
    # the smoke run: the profiler's peak instead (see _common.peak_bytes)
    return {k: (peak_bytes(steps[k], setup=clear) / 2**20, seconds) for k, (seconds, _) in measured.items()}


def gpu_section(small: bool = False, rounds: int = 10) -> str:
    from .gpu import BIG, SMALL

    device = torch.device("cuda") if torch.cuda.is_available() and not small else torch.device("cpu")
    if device.type == "cpu" and not small:
        raise SystemExit("benchmarks.budget --gpu needs a CUDA device; pass --small for a CPU smoke run")
    config = SMALL if small else BIG
    points = gpu_points(config, device, rounds)
    offload, nothing, dots = (points[k] for k in ("offload_dot_with_no_batch_dims()", "nothing_saveable", "dots_saveable"))
    peak_ratio, time_ratio = offload[0] / nothing[0], offload[1] / dots[1]
    if device.type == "cuda":
        plot(
            points,
            "memory_budget against fixed policies, GPT-style stack",
            "peak MiB",
            "median step time (ms), .backward()",
            PLOT.with_name("budget_gpu.png"),
        )
    lines = [
        "## GPU: memory_budget and offloading on the GPT-style stack",
        "",
        "Command: `python -m benchmarks.budget --gpu`" + (" (smoke run: `--small`, on the CPU)" if small else "") + ".",
        f"Device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}. {config.blocks} blocks, d={config.d}, {config.heads} heads, T={config.t}, "
        f"B={config.b}, {str(config.dtype).removeprefix('torch.')}; medians of {rounds} interleaved rounds.",
        "",
        table(["policy", "peak MiB", "step (ms)"], _rows(points, "MiB")),
        "",
        "Targets:",
        "",
        f"- offloading dots: peak <= 1.10x `nothing_saveable`'s: **{peak_ratio:.2f}**, "
        f"{'met' if peak_ratio <= 1.10 else 'NOT met'}",
        f"- offloading dots: step <= 1.05x `dots_saveable`'s: **{time_ratio:.2f}**, {'met' if time_ratio <= 1.05 else 'NOT met'}",
        "- memory_budget at 5 budgets dominates or matches every fixed policy:",
        "",
        *_verdicts(points),
        "",
        *_noise(points),
    ]
    return "\n".join(lines)


def write(section: str) -> None:
    """Put ``section`` into BENCHMARKS.md (``benchmarks.run`` keeps it: this benchmark takes about a
    minute, more than the 30 s a section of ``benchmarks.run`` may)."""
    write_block("python -m benchmarks.budget --write", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the GPT-style stack on a CUDA device")
    parser.add_argument("--small", action="store_true", help="the GPU section on a tiny configuration, on the CPU")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--write", action="store_true", help="also put the CPU section into BENCHMARKS.md")
    args = parser.parse_args()
    if args.gpu or args.small:
        print(gpu_section(small=args.small, rounds=args.rounds or (2 if args.small else 10)))
        return
    section = run(rounds=args.rounds or 9)
    print(section)
    if args.write:
        write(section)


if __name__ == "__main__":
    main()
