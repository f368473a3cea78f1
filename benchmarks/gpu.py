"""GPU benchmark: a GPT-style stack, remat against its peers, step time and peak memory.

    python -m benchmarks.gpu            # on a CUDA machine: the table of the speed issue
    python -m benchmarks.gpu --small    # a tiny configuration that also runs on a CPU (smoke test)

Two stacks of pre-norm blocks (LayerNorm, qkv Linear, causal
``F.scaled_dot_product_attention``, proj, MLP 4x with GELU):

* compute-bound: 12 blocks, d=1024, 16 heads, T=1024, B=8, bf16;
* launch-bound: 24 blocks, d=256, 4 heads, T=128, B=4, fp32.

Every variant runs in the same process, interleaved round by round; figures
are medians. Peak is ``torch.cuda.max_memory_allocated()`` during the step minus
what was allocated before it, with the parameters' ``.grad`` freed before each
step (outside the measurement), so every variant's peak includes the gradients it
makes. (Freed inside a ``.backward()`` step, as the first version of this table
did, the previous step's gradients count in "before" and are replaced during the
step: those peaks then leave the gradients out, where ``torch.func.grad``'s, which
returns them, keep them in. On the speed issue's stack that is 288 MiB, exactly the
gap between ``torch.func.grad`` + remat's 673 MiB and ``.backward()`` + remat's 385.)
funckpt runs with its default options (the determinism check on).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from functools import partial

import torch
import torch.func as tf
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from funckpt import policies, remat

from ._common import table


@dataclass(frozen=True)
class Config:
    blocks: int
    d: int
    heads: int
    t: int
    b: int
    dtype: torch.dtype


BIG = Config(12, 1024, 16, 1024, 8, torch.bfloat16)
LAUNCH_BOUND = Config(24, 256, 4, 128, 4, torch.float32)
SMALL = Config(2, 32, 2, 16, 2, torch.float32)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


_SAVED_BY_TORCH_SAC = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
]


def _sac_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_TORCH_SAC else CheckpointPolicy.PREFER_RECOMPUTE


def variants(config: Config, device: torch.device) -> dict[str, Callable[[], None]]:
    return variants_and_setup(config, device)[0]


def variants_and_setup(config: Config, device: torch.device) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """The steps, and what to run before each measured one: free the parameters' gradients."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(config.d, config.heads) for _ in range(config.blocks)).to(device, config.dtype)
    x = torch.randn(config.b, config.t, config.d, device=device, dtype=config.dtype)
    params = {k: v.detach() for k, v in blocks.named_parameters()}
    remat_blocks = [remat(b) for b in blocks]
    dots_blocks = [remat(b, policy=policies.dots_saveable) for b in blocks]
    sac = partial(create_selective_checkpoint_contexts, _sac_policy)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    def backward(call: Callable[[int, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            h = x
            for i in range(config.blocks):
                h = call(i, h)
            loss(h).backward()

        return step

    def func_grad(layers: list[nn.Module] | nn.ModuleList) -> Callable[[], None]:
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            h = x
            for i, layer in enumerate(layers):
                prefix = f"{i}."
                h = tf.functional_call(layer, {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}, (h,))
            return loss(h)

        return lambda: tf.grad(f)(params) and None

    def clear() -> None:
        blocks.zero_grad(set_to_none=True)

    return {
        ".backward(), no checkpointing": backward(lambda i, h: blocks[i](h)),
        ".backward() + torch.utils.checkpoint": backward(lambda i, h: checkpoint(blocks[i], h, use_reentrant=False)),
        ".backward() + remat": backward(lambda i, h: remat_blocks[i](h)),
        ".backward() + torch SAC (mm, attention)": backward(
            lambda i, h: checkpoint(blocks[i], h, use_reentrant=False, context_fn=sac)
        ),
        ".backward() + remat(dots_saveable)": backward(lambda i, h: dots_blocks[i](h)),
        "torch.func.grad, no checkpointing": func_grad(blocks),
        "torch.func.grad + remat": func_grad(remat_blocks),
    }, clear


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: Config, device: torch.device, rounds: int) -> dict[str, tuple[float, float]]:
    """Median step seconds and peak MiB per variant."""
    steps, clear = variants_and_setup(config, device)
    return measure_steps(steps, device, rounds, setup=clear)


def measure_steps(
    steps: dict[str, Callable[[], Any]],
    device: torch.device,
    rounds: int,
    setup: Callable[[], Any] | None = None,
) -> dict[str, tuple[float, float]]:
    """Median step seconds and peak MiB (NaN off CUDA) per step, rounds interleaved; ``setup`` before each."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    peaks: dict[str, float] = {}
    for _ in range(rounds):
        for name, step in steps.items():
            if setup is not None:
                setup()
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
            if device.type == "cuda":
                peaks[name] = max(peaks.get(name, 0.0), (torch.cuda.max_memory_allocated(device) - before) / 2**20)
    return {k: (statistics.median(v), peaks.get(k, float("nan"))) for k, v in times.items()}


def attention_kernels(step: Callable[[], Any]) -> str:
    """The attention operators one step runs (flash, efficient, cuDNN or the math fallback), from the profiler.

    Under ``torch.func`` transforms SDPA may pick another backend than under
    ``.backward()`` (the math one materialises every T x T score matrix): this
    column tells where a peak memory difference between the two APIs comes from.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = {
        e.name.removeprefix("aten::").removeprefix("_scaled_dot_product_")
        for e in prof.events()
        if "attention" in e.name and e.name != "aten::scaled_dot_product_attention" and not e.name.endswith("backward")
    }
    return ", ".join(sorted(names)) or "-"


def section(title: str, config: Config, device: torch.device, rounds: int) -> str:
    result = measure(config, device, rounds)
    kernels = {name: attention_kernels(step) for name, step in variants(config, device).items()}
    ckpt = result[".backward() + torch.utils.checkpoint"][0]
    rows = []
    for name, (t, peak) in result.items():
        base = result[("torch.func.grad" if name.startswith("torch.func") else ".backward()") + ", no checkpointing"][0]
        rows.append([f"`{name}`", f"{peak:.0f}", f"{t * 1e3:.1f}", f"{t / ckpt:.2f}", f"{t / base:.2f}", kernels[name]])
    return "\n".join(
        [
            f"### {title}",
            "",
            f"{config.blocks} blocks, d={config.d}, {config.heads} heads, T={config.t}, B={config.b}, "
            f"{str(config.dtype).removeprefix('torch.')}; medians of {rounds} interleaved rounds.",
            "",
            table(
                ["variant", "peak MiB", "step ms", "step / torch ckpt", "step / same API without checkpointing", "attention operators"],
                rows,
            ),
        ]
    )


def run(small: bool = False, rounds: int = 20) -> str:
    device = torch.device("cuda") if torch.cuda.is_available() and not small else torch.device("cpu")
    if device.type == "cpu" and not small:
        raise SystemExit("benchmarks.gpu needs a CUDA device; pass --small for a CPU smoke run")
    header = [
        "## GPU: a GPT-style stack",
        "",
        "Command: `python -m benchmarks.gpu`.",
        f"Device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.",
        "",
    ]
    if small:
        return "\n".join(header + [section("Smoke run (tiny configuration)", SMALL, device, rounds=2)])
    return "\n".join(
        header
        + [section("Compute-bound", BIG, device, rounds), "", section("Launch-bound", LAUNCH_BOUND, device, rounds)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny configuration, runs on a CPU")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print(run(small=args.small, rounds=args.rounds))


if __name__ == "__main__":
    main()
