"""``memory_budget``: which of a call's values to keep, from their bytes and recomputation costs.

Every value that ``everything_saveable`` would keep is a candidate. Its cost is
an estimate of the work its operator does, from shapes alone: FLOPs for the
operators ``torch.utils.flop_counter`` knows (matrix multiplies, convolutions,
attention), and for anything else the larger of the elements it reads and
writes (elementwise operators, reductions, normalizations). The candidates
are ranked by cost per byte, highest first (ties: earlier first), and the
longest prefix of that ranking whose bytes fit in ``fraction`` of all
candidates' bytes is kept.

Taking a prefix of one fixed ranking (rather than skipping a value that does
not fit and trying smaller ones) makes the choice nested: a larger fraction
keeps a superset, so it never keeps fewer bytes nor recomputes more. ``0.0``
keeps nothing, ``1.0`` keeps every candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Candidate", "Choice", "choose", "estimate_cost"]


def _flop_registry() -> dict[Any, Any]:
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:  # pragma: no cover - every supported torch has it
        return {}
    return dict(flop_registry)


_FLOPS = _flop_registry()


def _numel(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (tuple, list)):
        return sum(_numel(t) for t in x)
    return 0


def _attention_flops(args: tuple[Any, ...]) -> float | None:
    """``q @ k^T`` and ``p @ v`` for attention operators the registry lacks (the CPU kernel)."""
    q, k, v = (args + (None, None, None))[:3]
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    if min(q.dim(), k.dim(), v.dim()) < 2 or q.numel() == 0:
        return None
    batch = q.numel() // (q.shape[-2] * q.shape[-1])
    return 2.0 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _matrix_vector_flops(args: tuple[Any, ...]) -> float | None:
    """``mv``/``addmv``/``dot``/``vdot``: two FLOPs per element of the largest operand."""
    sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
    return 2.0 * max(sizes) if sizes else None


def _more_formulas() -> dict[Any, Any]:
    aten = torch.ops.aten
    table: dict[Any, Any] = {}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"):
        if hasattr(aten, name):
            table[getattr(aten, name)] = _attention_flops
    for name in ("mv", "addmv", "dot", "vdot"):
        if hasattr(aten, name):
            table[getattr(aten, name)] = _matrix_vector_flops
    return table


_MORE = _more_formulas()


def estimate_cost(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """Estimated work to recompute ``op``'s output: FLOPs where known, else elements touched."""
    packet = getattr(op, "overloadpacket", None)
    extra = _MORE.get(packet)
    if extra is not None:
        flops = extra(args[1:] if packet is getattr(torch.ops.aten, "addmv", None) else args)
        if flops is not None:
            return float(flops)
    formula = _FLOPS.get(packet)
    if formula is not None:
        try:
            # Called as torch's FlopCounterMode calls it (the formulas read shapes only).
            return float(formula(*args, out_val=out, **kwargs))
        except Exception:  # an unusual call signature: fall back to the size estimate
            pass
    return float(max(sum(_numel(a) for a in args), _numel(out), 1))


@dataclass(frozen=True)
class Candidate:
    """One value a budget may keep: its position in the op trace, bytes and estimated cost."""

    position: int
    nbytes: int
    cost: float


def choose(candidates: Sequence[Candidate], fraction: float) -> set[int]:
    """The positions to keep: the longest prefix, by cost per byte, within ``fraction`` of the bytes."""
    if fraction <= 0.0 or not candidates:
        return set()
    if fraction >= 1.0:
        return {c.position for c in candidates}
    total = sum(c.nbytes for c in candidates)
    # Whole bytes, forgiving the rounding of fraction * total (0.26 of 6160 is 1601.6, and
    # 1600 / 6160 * 6160 is 1599.99...): still monotone in the fraction.
    allowed = math.floor(fraction * total + 1e-6)
    ranked = sorted(candidates, key=lambda c: (-(c.cost / c.nbytes) if c.nbytes else float("-inf"), c.position))
    kept: set[int] = set()
    used = 0
    for c in ranked:
        if used + c.nbytes > allowed:
            break
        used += c.nbytes
        kept.add(c.position)
    return kept


@dataclass(frozen=True)
class Choice:
    """What a budget chose in one call: for :func:`~funckpt.print_saved_residuals`."""

    fraction: float
    candidates: Sequence[Candidate]
    kept: set[int]

    def summary(self) -> str:
        total = sum(c.nbytes for c in self.candidates)
        kept = sum(c.nbytes for c in self.candidates if c.position in self.kept)
        return (
            f"memory_budget({self.fraction:g}) kept {len(self.kept)} of {len(self.candidates)} candidate values, "
            f"{kept} of {total} bytes ({kept / total if total else 0.0:.0%}); the rest is recomputed"
        )
