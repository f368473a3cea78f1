"""Regenerate BENCHMARKS.md: ``python -m benchmarks.run`` from the repository root."""

from __future__ import annotations

from pathlib import Path

from . import compile, core, hf, overhead, policies, rng, sequential
from ._common import kept_blocks, machine_header

SECTIONS = [core.run, overhead.run, hf.run, policies.run, sequential.run, rng.run, compile.run]


def main() -> None:
    parts = [
        "# Benchmarks",
        "",
        "Regenerate everything on this page with `python -m benchmarks.run` (several minutes on 2 cores).",
        "All figures are ratios or values measured side by side in one run; none comes from a test.",
        "",
        machine_header(),
        "",
    ]
    for section in SECTIONS:
        parts += [section(), ""]
    path = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
    # Sections too slow for this command (python -m benchmarks.budget --write, benchmarks.loops --write)
    # are kept as they are.
    for block in kept_blocks(path.read_text()) if path.exists() else []:
        parts += [block, ""]
    path.write_text("\n".join(parts))
    print(path.read_text())


if __name__ == "__main__":
    main()
