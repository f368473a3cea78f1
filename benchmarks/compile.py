"""remat inside ``torch.compile`` (inductor) vs the peers, on the MLP-residual stack.

One ``.backward()`` gradient step of the core benchmark's model (8 blocks, batch
512, width 256, float32), with the loss function compiled by inductor:

* compiled, no checkpointing;
* compiled, ``torch.utils.checkpoint(use_reentrant=False)`` per block;
* compiled, ``remat`` per block: lowered to the compiler's checkpoint region;
* compiled, ``remat`` per block with a names policy: the eager path, one graph
  break per block (the policy names nothing, so it keeps what the default keeps);

and, uncompiled, plain ``.backward()`` and ``remat`` for reference. Peak memory
from the profiler in activation-sizes (0.5 MiB), including the 32 activation-sizes
of parameter gradients; step time is the median over rounds that run the
variants in turn, after compilation.

    python -m benchmarks.compile
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from funckpt import policies, remat

from ._common import table
from .core import Variant, peaks, stack_inputs, step_times
from .mlp_stack import block, loss_fn


def variants(depth: int = 8) -> list[Variant]:
    params, x, leaves, clear = stack_inputs(depth)

    def step_of(block_fn: Callable[..., torch.Tensor], compiled: bool) -> Callable[[], Any]:
        def loss(leaves: Any, x: torch.Tensor) -> torch.Tensor:
            return loss_fn(leaves, x, block_fn)

        # Each variant gets its own code object, as separate programs would: Dynamo caches
        # compiled frames per code object, and a cache entry that graph-breaks at block_fn
        # (the names-policy variant's) would also serve the other variants' calls.
        loss.__code__ = loss.__code__.replace()
        fn = torch.compile(loss, backend="inductor", dynamic=False) if compiled else loss

        def step() -> Any:
            fn(leaves, x).backward()
            return [v.grad for p in leaves for v in p.values()]

        return step

    def torch_ckpt(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, p, x, use_reentrant=False)

    names = remat(block, policy=policies.save_only_these_names("nothing"))
    return [
        Variant("compiled", step_of(block, True), clear),
        Variant("compiled + torch.utils.checkpoint", step_of(torch_ckpt, True), clear),
        Variant("compiled + remat", step_of(remat(block), True), clear),
        Variant("compiled + remat, names policy (eager region)", step_of(names, True), clear),
        Variant("eager", step_of(block, False), clear),
        Variant("eager + remat", step_of(remat(block), False), clear),
    ]


def run(rounds: int = 9) -> str:
    torch._dynamo.reset()
    vs = variants()
    peak = peaks(vs)  # also compiles every variant, outside the timed rounds
    times = step_times(vs, rounds)
    ckpt = "compiled + torch.utils.checkpoint"
    rows = [
        [
            f"{v.name}",
            f"{peak[v.name]:.1f}",
            f"{peak[v.name] / peak[ckpt]:.2f}",
            f"{times[v.name] * 1e3:.0f}",
            f"{times[v.name] / times[ckpt]:.2f}",
            f"{times[v.name] / times['compiled']:.2f}",
        ]
        for v in vs
    ]
    r = "compiled + remat"
    out = [
        "## remat inside torch.compile (inductor, 8 blocks, batch 512, width 256)",
        "",
        "Command: `python -m benchmarks.compile` (part of `python -m benchmarks.run`).",
        "",
        "One `.backward()` step with the loss compiled by inductor. A remat'd call with no policy or an",
        "operator-based one becomes the compiler's own checkpoint region; one with a names policy runs",
        f"eagerly between graphs. Peak in activation-sizes (0.5 MiB; 32 are parameter gradients); time is",
        f"the median of {rounds} rounds after compilation.",
        "",
        table(
            ["variant", "peak (act.)", "peak / compiled torch ckpt", "step (ms)", "time / compiled torch ckpt", "time / compiled"],
            rows,
        ),
        "",
        f"- compiled remat, peak / compiled torch.utils.checkpoint: **{peak[r] / peak[ckpt]:.2f}**; "
        f"step time: **{times[r] / times[ckpt]:.2f}**",
        f"- compiled remat, peak / compiled without checkpointing: **{peak[r] / peak['compiled']:.2f}**",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(run())
