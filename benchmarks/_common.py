"""Shared measurement helpers for the benchmarks (not a test).

Peak memory on CPU comes from the PyTorch profiler: the step runs under
``torch.profiler.profile(profile_memory=True)``, and the peak is the maximum of
the running sum of the ``[memory]`` events' byte counts in time order. That
counts only what the step itself allocates (its results are kept alive until
the profiler stops, and nothing allocated before the step is freed inside it).
"""

from __future__ import annotations

import datetime
import gc
import re
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(step: Callable[[], Any], setup: Callable[[], Any] | None = None) -> int:
    """Peak bytes allocated (and not yet freed) during one call of ``step``.

    ``setup`` runs first, outside the profiler: use it to drop state (such as
    ``.grad`` fields) that the step would otherwise free inside the profile,
    which would make the peak look smaller than it is.
    """
    return _memory(step, setup)[0]


def held_bytes(step: Callable[[], Any], setup: Callable[[], Any] | None = None) -> int:
    """Bytes that ``step`` allocated and its result still holds when it returns.

    With ``step`` a forward pass that returns what the backward pass needs (a
    loss with its graph, or ``torch.func.vjp``'s closure), this is the memory
    kept between the forward and the backward pass.
    """
    return _memory(step, setup)[1]


def _memory(step: Callable[[], Any], setup: Callable[[], Any] | None) -> tuple[int, int]:
    if setup is not None:
        setup()
    # Garbage left in reference cycles by earlier code (a test's model, torch's
    # own closures) would otherwise be freed by a collection inside the profile
    # and counted against the step.
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    del result
    # The raw kineto events keep every allocation and free as its own
    # "[memory]" event (prof.events() folds them into their enclosing ops).
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak, running


def median_seconds(step: Callable[[], Any], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_header() -> str:
    return (
        f"Measured on {platform.machine()} {platform.processor() or ''} with "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}, on {datetime.date.today().isoformat()}."
    ).replace("  ", " ")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def _markers(command: str) -> tuple[str, str]:
    return f"<!-- begin: {command} -->", f"<!-- end: {command} -->"


def write_block(command: str, section: str, path: Path = BENCHMARKS_MD) -> None:
    """Put ``section`` into BENCHMARKS.md between markers naming ``command``, which made it.

    For benchmarks too slow for ``python -m benchmarks.run``: it keeps such blocks as they are.
    """
    begin, end = _markers(command)
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def kept_blocks(text: str) -> list[str]:
    """Every block :func:`write_block` put into ``text``, markers included, in order."""
    return [m.group(0) for m in re.finditer(r"<!-- begin: (.*?) -->.*?<!-- end: \1 -->", text, flags=re.S)]
