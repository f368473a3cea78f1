"""Host work per call, counted in CPU instructions: the per-call overhead, unaffected by load.

``benchmarks.overhead`` times the host-bound step; on a machine that other processes share
(2 cores here, CI runners, a laptop) its figures move by tens of percent from run to run, more
than most changes to the per-call path. This benchmark counts the instructions that one step
executes instead, under valgrind's callgrind, which gives the same count on every run: each
variant runs in a child process under callgrind, warms up uninstrumented, then switches
instrumentation on and counts only the measured steps (``--toggle-collect`` on the C function
that drives them). Instructions are not time (a cache miss or a kernel costs more than an add),
but on these tiny blocks the step is Python and torch's dispatch, where they track each other:
use it to see what a change to the per-call path costs, ``benchmarks.overhead`` for the time.

Variants: the stack of 32 tiny blocks of ``benchmarks.overhead`` (``.backward()`` with no
checkpointing, ``torch.utils.checkpoint`` and remat; ``torch.func.grad`` with none and remat),
the forward pass alone of each, and one GPT-style block of the module stack (forward, and a
whole step), per call; and the GPT block's step keeping its matrix multiplies and attention
(``dots_saveable``, against torch's selective checkpointing saving the same operators). Needs ``valgrind`` on the PATH.

    python -m benchmarks.instructions            # print the table
    python -m benchmarks.instructions --write    # ... and put that section into BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.func as tf
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from funckpt import policies, remat

from ._common import table, write_block
from .overhead import BLOCKS, GPTBlock, block

ROUNDS = 2  # measured steps per variant (the count is the same every run: two show it is per step)


def _tiny(variant: str) -> tuple[Callable[[], object], int]:
    """One step of a tiny-block variant, and how many checkpointed calls it makes."""
    torch.manual_seed(0)
    ws = [(torch.randn(16, 16) / 4).requires_grad_() for _ in range(BLOCKS)]
    plain_ws = [w.detach() for w in ws]
    x = torch.randn(8, 16)
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = {
        "none": block,
        "torch.utils.checkpoint": lambda w, h: checkpoint(block, w, h, use_reentrant=False),
        "remat": remat(block),
    }[variant.split(", ")[1]]

    def loss(wl: list[torch.Tensor]) -> torch.Tensor:
        h = x
        for w in wl:
            h = call(w, h)
        return h.sum()

    api = variant.split(", ")[0]
    if api == ".backward()":
        return (lambda: loss(ws).backward()), BLOCKS
    if api == "forward":
        return (lambda: loss(ws)), BLOCKS
    return (lambda: tf.grad(loss)(plain_ws)), BLOCKS


def _gpt(variant: str) -> tuple[Callable[[], object], int]:
    """One GPT-style block (``benchmarks.overhead``'s), called once per step."""
    torch.manual_seed(0)
    b = GPTBlock()
    x = torch.randn(2, 8, 32, requires_grad=True)
    sac = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
    call: Callable[[torch.Tensor], torch.Tensor] = {
        "none": b,
        "torch.utils.checkpoint": lambda h: checkpoint(b, h, use_reentrant=False),
        "remat": remat(b),
        "torch selective checkpointing": lambda h: checkpoint(b, h, use_reentrant=False, context_fn=sac),
        "remat dots_saveable": remat(b, policy=policies.dots_saveable),
    }[variant.split(", ")[1]]
    if variant.startswith("GPT block forward"):
        return (lambda: call(x)), 1
    return (lambda: call(x).sum().backward()), 1


TINY = [
    ".backward(), none",
    ".backward(), torch.utils.checkpoint",
    ".backward(), remat",
    "forward, none",
    "forward, torch.utils.checkpoint",
    "forward, remat",
    "torch.func.grad, none",
    "torch.func.grad, remat",
]
GPT = [f"GPT block {what}, {how}" for what in ("forward", "step") for how in ("none", "torch.utils.checkpoint", "remat")]
#: Saving the matrix multiplies and attention: torch's selective checkpointing and remat's
#: ``dots_saveable``, the same operators kept (their overhead ratio is to the first's).
SAVING = [f"GPT block step, {how}" for how in ("torch selective checkpointing", "remat dots_saveable")]


def _sac_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """What ``dots_saveable`` keeps of the GPT block on the CPU, as a selective-checkpointing policy."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SAC else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED_BY_SAC = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _step(variant: str) -> tuple[Callable[[], object], int]:
    return _gpt(variant) if variant.startswith("GPT") else _tiny(variant)


def child(variant: str, rounds: int = ROUNDS) -> None:
    """Run in the child under callgrind: warm up, switch instrumentation on, run ``rounds`` steps
    inside ``itertools.takewhile``'s C function (what ``--toggle-collect`` counts)."""
    torch.set_num_threads(1)
    step, _ = _step(variant)
    for _ in range(3):
        step()
    if shutil.which("callgrind_control"):
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=False)

    def measured(_: int) -> bool:
        for _ in range(rounds):
            step()
        return True

    list(itertools.takewhile(measured, range(1)))


def count(variant: str, rounds: int = ROUNDS) -> float:
    """Instructions per checkpointed call of ``variant`` (counted in a child process)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            "--toggle-collect=takewhile_next",
            f"--callgrind-out-file={tmp}/out",
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--child",
            variant,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    found = re.search(r"Collected\s*:\s*([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind for {variant!r}:\n{done.stderr[-2000:]}")
    calls = _step(variant)[1]
    return int(found.group(1).replace(",", "")) / (rounds * calls)


def run(jobs: int | None = None) -> str:
    if shutil.which("valgrind") is None:
        return "valgrind is not installed: no instruction counts (install it, or use benchmarks.overhead)."
    variants = TINY + GPT + SAVING
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        counts = dict(zip(variants, pool.map(count, variants)))
    rows = []
    for v in variants:
        api = v.rsplit(", ", 1)[0]
        base = counts[f"{api}, none"]
        peer = counts.get(f"{api}, {'torch selective checkpointing' if v in SAVING else 'torch.utils.checkpoint'}")
        own = v.endswith(", none")
        ratio = "-" if own or peer is None else f"{(counts[v] - base) / (peer - base):.2f}"
        rows.append([f"`{v}`", f"{counts[v] / 1e3:.1f}", "-" if own else f"{(counts[v] - base) / 1e3:.1f}", ratio])
    lines = [
        f"torch {torch.__version__}, Python {sys.version.split()[0]}; instructions per call, in thousands "
        f"(tiny blocks: per checkpointed call of a 32-call step; GPT block: per call). The last two rows keep the "
        f"block's matrix multiplies and attention (remat's `dots_saveable`, torch's selective checkpointing with "
        f"the same operators); their ratio is to the latter's overhead.",
        "",
        table(["variant", "instructions per call (k)", "over the same API without checkpointing (k)", "overhead / torch.utils.checkpoint's"], rows),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=None, help="child processes at once (default: the CPU count)")
    parser.add_argument("--write", action="store_true", help="also put the section into BENCHMARKS.md")
    options = parser.parse_args()
    if options.child:
        child(options.child)
        return
    report = run(options.jobs)
    print(report)
    if options.write and report.startswith("torch"):
        write_block("python -m benchmarks.instructions --write", section(report))


def section(report: str) -> str:
    return "\n".join(
        [
            "## Per-call overhead in instructions (CPU, deterministic)",
            "",
            "Command: `python -m benchmarks.instructions --write` (a few minutes under valgrind, so not part of",
            "`python -m benchmarks.run`). The variants of the per-call overhead section, each counted in",
            "instructions under callgrind: the same count on every run, whatever else the machine runs, so",
            "what a change to the per-call path costs shows even where timings are noise. Instructions are",
            "not time; `benchmarks.overhead` has the time.",
            "",
            report,
        ]
    )


if __name__ == "__main__":
    main()
