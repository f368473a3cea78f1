"""Per-call overhead of a remat'd call: tiny blocks, where the host's Python is all there is.

A stack of 32 tiny blocks (8x16 input, a 16x16 matmul and a tanh each), one
gradient step per round, every variant interleaved in each round, medians over
the rounds. The per-call overhead of a checkpointing method is its step time
minus the same API's step without checkpointing, divided by the 32 calls. This
is the CPU proxy for the host-bound GPU step (the GPU's kernels are as short as
these). ``determinism_check="none"`` runs alongside, so the difference is what
the determinism check costs per call.

A second stack is the CPU proxy for the issue's launch-bound GPU stack: 12 tiny
GPT-style ``nn.Module`` blocks (pre-norm LayerNorm, qkv ``Linear``, causal
``scaled_dot_product_attention``, projection, GELU MLP; width 32, 4 heads, 8
tokens, batch 2), checkpointed per block, where the host's cost per operator
(the substitution mode, module reparametrization) shows, not only the cost per call.

    python -m benchmarks.overhead
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
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


D, HEADS, T, B, LAYERS = 32, 4, 8, 2, 12


class GPTBlock(nn.Module):
    """A pre-norm transformer block at host-bound sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(D, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def module_variants() -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (API, one gradient step) for the stack of GPT blocks."""
    torch.manual_seed(0)
    blocks = [GPTBlock() for _ in range(LAYERS)]
    x = torch.randn(B, T, D)
    stacks = {
        "no checkpointing": nn.Sequential(*blocks),
        "torch.utils.checkpoint": nn.Sequential(*blocks),
        "remat": nn.Sequential(*(remat(b) for b in blocks)),
    }
    out: dict[str, tuple[str, Callable[[], object]]] = {}
    for name, model in stacks.items():
        if name == "torch.utils.checkpoint":

            def forward(x: torch.Tensor, model: nn.Module = model) -> torch.Tensor:
                for b in model:
                    x = checkpoint(b, x, use_reentrant=False)
                return x

        else:
            forward = model
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor], model: nn.Module = model) -> torch.Tensor:
            return tf.functional_call(model, p, (x,)).pow(2).mean()

        out[f".backward(), {name}"] = (".backward()", lambda forward=forward: forward(x).pow(2).mean().backward())
        if name != "torch.utils.checkpoint":
            out[f"torch.func.grad, {name}"] = ("torch.func.grad", lambda loss=loss, p=params: tf.grad(loss)(p))
    return out


def measure(rounds: int = 60, steps: dict[str, tuple[str, Callable[[], object]]] | None = None) -> dict[str, float]:
    """Median step time per variant, in seconds."""
    steps = variants() if steps is None else steps
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
    mod = measure(max(rounds // 3, 2), module_variants())
    mod_rows = [[f"`{name}`", f"{t * 1e3:.2f}"] for name, t in mod.items()]
    step_ratio = mod[".backward(), remat"] / mod[".backward(), torch.utils.checkpoint"]
    grad_ratio = mod["torch.func.grad, remat"] / mod[".backward(), torch.utils.checkpoint"]
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
            "",
            f"**Module blocks** (the CPU proxy for the launch-bound GPU stack): {LAYERS} GPT-style blocks",
            f"(width {D}, {HEADS} heads, {T} tokens, batch {B}), checkpointed per block, medians of",
            f"{max(rounds // 3, 2)} interleaved rounds:",
            "",
            table(["variant", "step (ms)"], mod_rows),
            "",
            f"Step of `.backward()` + remat / `.backward()` + `torch.utils.checkpoint`: **{step_ratio:.2f}x**;",
            f"`torch.func.grad` + remat / `.backward()` + `torch.utils.checkpoint`: **{grad_ratio:.2f}x**.",
        ]
    )


if __name__ == "__main__":
    print(run())
