"""nn.Sequential: peak memory vs depth with sqrt(n) segments (issue: modules).

A stack of residual MLP layers (width 64, hidden 256, batch 4096, float32: the
activations dominate, parameter gradients are small). For 8, 16, 32 and 64
layers: no remat, per-layer ``remat``, ``remat(seq)`` in about sqrt(n)
segments, under ``torch.func.grad`` (through ``functional_call``) and
``.backward()``, beside ``torch.utils.checkpoint.checkpoint_sequential`` with
the same segments under ``.backward()``. Peak memory from the profiler, in
activation-sizes (4096 x 64 x 4 bytes = 1 MiB).

    python -m benchmarks.sequential
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
import torch.func as tf
import torch.utils.checkpoint as upstream

from funckpt import remat
from funckpt._modules import default_segments

from ._common import peak_bytes, table

BATCH, WIDTH = 4096, 64
ACTIVATION = BATCH * WIDTH * 4
DEPTHS = (8, 16, 32, 64)
PLOT = Path(__file__).resolve().parent / "sequential.png"


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def measure(depth: int) -> dict[str, float]:
    torch.manual_seed(0)
    seq = torch.nn.Sequential(*[Residual() for _ in range(depth)])
    x = torch.randn(BATCH, WIDTH)
    k = default_segments(depth)
    models = {
        "no remat": seq,
        "per-layer remat": torch.nn.Sequential(*[remat(layer) for layer in seq]),
        f"remat(seq), sqrt(n) segments": remat(seq),
    }
    params = dict(seq.named_parameters())

    def clear() -> None:
        for p in seq.parameters():
            p.grad = None

    out: dict[str, float] = {}
    for name, model in models.items():

        def grad_step(model: torch.nn.Module = model) -> object:
            return tf.grad(lambda p: tf.functional_call(model, p, (x,)).square().mean())(params)

        def backward_step(model: torch.nn.Module = model) -> object:
            model(x).square().mean().backward()
            return [p.grad for p in seq.parameters()]

        grad_step()
        out[f"torch.func.grad, {name}"] = peak_bytes(grad_step) / ACTIVATION
        backward_step()
        out[f".backward(), {name}"] = peak_bytes(backward_step, setup=clear) / ACTIVATION

    def torch_sequential() -> object:
        upstream.checkpoint_sequential(seq, k, x, use_reentrant=False).square().mean().backward()
        return [p.grad for p in seq.parameters()]

    torch_sequential()
    out[".backward(), torch checkpoint_sequential"] = peak_bytes(torch_sequential, setup=clear) / ACTIVATION
    return out


def _exponent(xs: tuple[int, ...], ys: list[float]) -> float:
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def plot(results: dict[int, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in results[DEPTHS[0]]:
        ax.plot(DEPTHS, [results[d][name] for d in DEPTHS], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("layers")
    ax.set_ylabel("peak memory (activation-sizes)")
    ax.set_title("nn.Sequential: peak memory vs depth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)


def run() -> str:
    results = {d: measure(d) for d in DEPTHS}
    plot(results)
    names = list(results[DEPTHS[0]])
    rows = [[f"`{n}`"] + [f"{results[d][n]:.1f}" for d in DEPTHS] + [f"{_exponent(DEPTHS, [results[d][n] for d in DEPTHS]):.2f}"] for n in names]
    sqrt_name = ".backward(), remat(seq), sqrt(n) segments"
    torch_name = ".backward(), torch checkpoint_sequential"
    ratios = [results[d][sqrt_name] / results[d][torch_name] for d in DEPTHS]
    exponent = _exponent(DEPTHS, [results[d]["torch.func.grad, remat(seq), sqrt(n) segments"] for d in DEPTHS])
    return "\n".join(
        [
            "## nn.Sequential: peak memory vs depth",
            "",
            "Command: `python -m benchmarks.sequential` (part of `python -m benchmarks.run`). Residual MLP",
            f"layers, width {WIDTH}, hidden {4 * WIDTH}, batch {BATCH}; segments = round(sqrt(layers)). Peak memory in",
            "activation-sizes (1 MiB), parameter gradients included; the exponent is the slope of a log-log fit.",
            "",
            table(["variant"] + [f"{d} layers" for d in DEPTHS] + ["fitted exponent"], rows),
            "",
            "![peak memory vs depth](benchmarks/sequential.png)",
            "",
            "Targets:",
            "",
            f"- sqrt(n) segmentation under torch.func.grad grows as depth^{exponent:.2f} (target about 0.5)",
            "- sqrt(n) segmentation within 1.10x of torch's checkpoint_sequential at every depth (.backward()): "
            + ", ".join(f"{d}: **{r:.2f}**" for d, r in zip(DEPTHS, ratios))
            + f" ({'met' if max(ratios) <= 1.10 else 'NOT met'})",
        ]
    )


if __name__ == "__main__":
    print(run())
