"""Errors, the determinism check and the debug operator traces.

A recomputation must compute what the forward run computed, or the gradients it
yields belong to a different function. With ``determinism_check="default"``
every recomputation compares its outputs against the forward run's:

* their metadata (shape, dtype, device), exactly;
* their values, through a two-number digest of each output (the sum and L2
  norm of its values: two reductions on the CPU, one ``std_mean`` launch on an
  accelerator, from which they follow), within a tolerance set by the dtype.

Comparing values, not the operators or the autograd graph that produced them,
is what makes the check free of false alarms: ATen decomposes an operator
differently with and without a dispatch mode, with and without grad, under
``vmap`` or not; kernels (SDPA backends, cuDNN algorithms) are chosen per
call; autocast, Python object identity and torch.func levels all differ
between the forward run and a recomputation, and none of that changes values
beyond rounding. And it catches what matters under every transform alike,
because the digest is taken of the plain tensor under all functorch wrappers:
a recomputation that takes another path (``sin`` then ``cos``), slices
differently, reads an exhausted iterator or a changed global, or starts from an
input modified in place after the call. The cost is one reduction per output
per run, and on an accelerator one host synchronisation at the end of each
backward pass (the comparisons are deferred to it).

With ``preserve_rng_state=False`` random operators legitimately draw other
values, and a forward run that allocated uninitialized memory (``torch.empty``
and kin) may compute from garbage, so for those only the metadata is compared. With ``debug=True`` both runs also
record the ATen operators they executed, and the error shows the two traces
side by side from the first divergence.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as _fwAD

from ._internals import (
    PLAIN_TENSORS,
    DispatchMode,
    has_gradient_dtype,
    current_graph_task_id,
    queue_engine_callback,
    DisableFuncTorch,
    dispatch_modes_active,
    forward_ad_level,
    is_batchedtensor,
    is_functorch_wrapped,
    maybe_get_bdim,
    maybe_get_level,
    set_fwd_grad_enabled,
    set_grad_enabled,
    torch_function_mode_enabled,
    transforms_active,
    unwrap_one_level,
)

__all__ = ["CheckpointError", "set_checkpoint_debug_enabled"]

DETERMINISM_CHECKS = ("default", "none")


class CheckpointError(RuntimeError):
    """Raised where remat cannot give the right gradient: the message says what to do.

    For example when the recomputation does not reproduce the forward pass, or
    when a differentiable tensor cannot be routed:

        >>> import torch, funckpt
        >>> class Holder:
        ...     w = torch.ones(2, requires_grad=True)
        >>> try:
        ...     funckpt.remat(lambda x: x * Holder.w)(torch.ones(2))
        ... except funckpt.CheckpointError as e:
        ...     print("Pass the tensor" in str(e))
        True
    """


# --------------------------------------------------------------------------- debug


class _DebugState(threading.local):
    override: bool | None = None


_debug_state = _DebugState()


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Context manager that sets ``debug`` for every checkpoint inside it.

    ``True`` or ``False`` overrides the ``debug=`` argument of each call;
    ``None`` restores the per-call setting. Mirrors
    ``torch.utils.checkpoint.set_checkpoint_debug_enabled``.

    Example::

        >>> import torch, funckpt
        >>> with funckpt.set_checkpoint_debug_enabled(True):
        ...     y = funckpt.remat(torch.sin)(torch.ones(2, requires_grad=True))
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_checkpoint_debug_enabled: enabled must be a bool or None, got {enabled!r}")
    previous = _debug_state.override
    _debug_state.override = enabled
    try:
        yield
    finally:
        _debug_state.override = previous


def debug_enabled(requested: bool) -> bool:
    """The effective ``debug`` flag: the context manager's override wins."""
    override = _debug_state.override
    return requested if override is None else override


class OpTrace(DispatchMode):
    """Records ``op -> output shapes`` for every ATen operator executed under it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.lines: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        shapes = [
            f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
            for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor)
        ]
        self.lines.append(f"{func} -> {', '.join(shapes) or '()'}")
        return out


class TracedDraws(DispatchMode):
    """Refuses a recomputation that draws random numbers while ``make_fx`` records it into a graph
    (``torch.func.linearize``, ``torch.export``, a ``make_fx`` of a training step).

    remat replays the generator states the forward run started from, with ``Generator.set_state``,
    which no graph records: where the recorded program runs, the recomputation's random operators
    draw other numbers than its forward pass's did (another dropout mask), and the gradient is
    silently wrong. Entered with the generators' replay (``UserRegion._replays``: a recomputation's,
    a checkpointed loop's backward sweep) only under such a tracer (see
    :func:`~funckpt._internals.graph_traced`); a random operator a saving policy's replayer answers
    from the forward run's value never reaches it.
    """

    def __init__(self, name: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.name = name
        self.drew: Any = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.drew is None and torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = func
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if exc[0] is None and self.drew is not None:
            raise CheckpointError(
                f"remat({self.name}): the function draws random numbers ({self.drew}) and its recomputation "
                "is being recorded into a graph by make_fx (torch.func.linearize, torch.export, or a "
                "make_fx of the training step). remat replays the random numbers by restoring the "
                "generators' states, which the graph does not record: where the graph runs, the "
                "recomputation would draw other numbers than the forward pass (another dropout mask) "
                "and the gradient would silently be wrong. Trace the function without remat, draw the "
                "random values outside the remat'd function and pass them in, or use torch.compile, "
                "where remat becomes the compiler's own checkpoint."
            )


def format_traces(forward: Sequence[str], recompute: Sequence[str], context: int = 5) -> str:
    """Both operator traces, from a few lines before their first divergence."""
    first = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute)) if a != b),
        min(len(forward), len(recompute)),
    )
    start = max(0, first - context)
    lines = [f"operator traces (first divergence at operator #{first}):"]
    for title, trace in (("forward", forward), ("recomputation", recompute)):
        lines.append(f"  {title} ({len(trace)} operators):")
        lines += [f"    {i:4d}  {trace[i]}" for i in range(start, min(len(trace), first + context + 1))]
    return "\n".join(lines)


# --------------------------------------------------------------------- determinism


def _with_traces(message: str, traces: tuple[Sequence[str], Sequence[str]] | None) -> str:
    """The message, with both runs' operator traces (``debug=True``) or how to get them."""
    if traces is None:
        return message + " Pass debug=True to see the operators each run executed."
    return message + "\n" + format_traces(*traces)


def tensor_meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device)


#: Said where a tensor the function kept outside the call (an output from ``kept_from`` on,
#: see ``UserRegion._escaped_tensors``) differs: what went wrong is most likely where it was found.
KEPT_HINT = (
    " remat finds a tensor the function kept outside the call again by its position among the "
    "tensors the function's operators return: a recomputation that runs other operators before it "
    "(a table or mask a module makes on its first call only, a branch on state that changed since "
    "the forward pass) finds another tensor there. Make the function run the same operators on "
    "every call, or return that tensor from the function."
)


#: Said where a recomputation under ``torch.autocast`` and a ``torch.func`` transform differs (see
#: ``UserRegion.recompute``, ``LoopRegion.check_step_again``): torch.func changes what autocast computes.
AUTOCAST_UNDER_TRANSFORMS_HINT = (
    "\nUnder torch.autocast this can come from torch.func itself: what autocast computes depends on the "
    "transforms the function runs under (a vmap's batching rules dispatch before autocast, a grad or jvp "
    "level's autograd after it: a Linear with a bias gives float32 under vmap(f), bfloat16 under "
    "vmap(grad(f))), and so does how a composite operator decomposes (linear of a vector is one fused addmm "
    "on plain tensors, a matmul then an add, rounded twice in bfloat16, on a transform's). remat runs this "
    "call's forward run and its recomputation under different transforms with a saving policy under "
    "vmap(grad), vmap(jvp) or vmap(jacrev) (policy=None runs these as the function without remat does), "
    "in a checkpointed loop differentiated under vmap or jacrev, and in jacfwd or hessian of an input the "
    "vmap does not batch. Casting explicitly inside the function (x.to(torch.bfloat16), and the weights) in "
    "place of autocast gives the same dtypes under every transform."
)


def _output_words(i: int, kept_from: int | None) -> str:
    if kept_from is None or i < kept_from:
        return f"output tensor {i}"
    return "a tensor the function kept outside the call (in a hook's list, an attribute)"


def check_same_outputs(
    name: str,
    forward_meta: Sequence[tuple[Any, ...]],
    recomputed: Sequence[torch.Tensor],
    traces: tuple[Sequence[str], Sequence[str]] | None,
    kept_from: int | None = None,
) -> None:
    """Raise :class:`CheckpointError` if the recomputed outputs' metadata differ.

    ``kept_from``: the index of the first output that is a tensor the function kept
    outside the call (named as such, with a word on how it is found again)."""
    problems = []
    if len(forward_meta) != len(recomputed):
        problems.append(
            f"the forward pass returned {len(forward_meta)} tensors, the recomputation {len(recomputed)}"
        )
    kept = False
    for i, (meta, t) in enumerate(zip(forward_meta, recomputed)):
        for what, a, b in zip(("shape", "dtype", "device"), meta, tensor_meta(t)):
            if a != b:
                kept = kept or (kept_from is not None and i >= kept_from)
                problems.append(
                    f"{_output_words(i, kept_from)}: {what} was {a} in the forward pass, {b} in the recomputation"
                )
    if not problems:
        return
    message = (
        f"remat({name}): {the_recomputation()} did not reproduce the forward pass:\n  "
        + "\n  ".join(problems)
        + "\nThe function must compute the same thing when called again with the same inputs "
        "(no dependence on global state that changes between forward and backward)."
        + (KEPT_HINT if kept else "")
        + " Pass determinism_check='none' to skip this check."
    )
    raise CheckpointError(_with_traces(message, traces))


# ------------------------------------------------------------- value digests

# Relative tolerance of the value digest, by dtype: a recomputation running the same
# kernels on the same inputs usually reproduces the forward bit for bit; these leave
# room for reduction-order differences (atomics, another kernel or decomposition).
_RTOL = {
    torch.float64: 1e-10,
    torch.complex128: 1e-10,
    torch.float32: 1e-4,
    torch.complex64: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
_RTOL_OTHER_FLOAT = 1e-1  # 8-bit floating-point types
#: An integer or boolean output's (accumulated in float64): its values are exact, but their sum of
#: squares (and beyond 2**53 their sum) is rounded, differently where the two runs lay the values out
#: differently (a batched output under vmap, a transposed one) and reduce them in another order. A
#: change of one value by 1 still moves the sum beyond it while the values times their number stay
#: below 1e12 (token ids, indices, masks).
_RTOL_EXACT = 1e-12
_CPU_RTOL = {torch.float32: _RTOL[torch.float32], torch.float64: _RTOL[torch.float64]}


class Digest:
    """The sum and L2 norm of one output's values, and how to compare them.

    On the CPU both are computed by two plain reductions (``sum`` and
    ``vector_norm`` are vectorised and many times faster there than a Welford
    ``std_mean``: 15 against 200 us for 64x1024 floats) and read into ``values``
    at once (reading costs no synchronisation there, and the comparison is then
    plain Python). On an accelerator one ``std_mean`` kernel keeps ``(std, mean)``
    on the device as ``stats`` (``moments``: one launch, no synchronisation) until
    the comparison reads them, every pending digest of a device at once, and turns
    them into the sum and norm. Where ``stats`` hold the sum and norm themselves
    (``moments`` false: a digest left unread on the CPU, or of a dtype ``std_mean``
    does not read, converted piece by piece), they are read as they are.
    """

    __slots__ = ("batch_dims", "moments", "numel", "rtol", "sampled", "stats", "values", "weighted", "weighted_sum")

    def __init__(
        self,
        stats: tuple[torch.Tensor, torch.Tensor] | None,
        numel: int,
        rtol: float,
        values: tuple[float, float] | None = None,
        *,
        moments: bool = False,
        weighted: tuple[float | torch.Tensor | None, int] = (None, 0),
        weighted_sum: bool = False,
        batch_dims: int = 0,
    ) -> None:
        self.stats, self.numel, self.rtol, self.values, self.moments = stats, numel, rtol, values, moments
        # The first of ``values`` is the position-weighted sum of all the values, not their sum (a
        # small output on the CPU: one reduction where the sum and a weighted sample would take two).
        self.weighted_sum = weighted_sum
        # The position-weighted sum (see _weighted), a number or a tensor not read yet, and of how many values.
        self.weighted, self.sampled = weighted
        # How many vmap batch dimensions lead the values it read (see _batch_first): two runs' weighted
        # sums are of the same positions where they read as many values with as many of them.
        self.batch_dims = batch_dims

    def from_stats(self, first: float, second: float) -> tuple[float, float]:
        """Sum and L2 norm of the values, from ``stats`` as read: ``(std, mean)`` where they are moments."""
        if not self.moments:
            return first, second
        std, mean = first, second
        return mean * self.numel, math.sqrt(max(std * std + mean * mean, 0.0) * self.numel)

    def read(self) -> tuple[float, float]:
        """``(sum, norm)`` as numbers (a host synchronisation on an accelerator)."""
        if self.values is not None:
            return self.values
        assert self.stats is not None
        first, second = (float(n) for n in torch.stack(self.stats).tolist())
        return self.from_stats(first, second)

    def read_weighted(self) -> float | None:
        """The position-weighted sum as a number, if taken (a host synchronisation on an accelerator)."""
        return float(self.weighted.item()) if isinstance(self.weighted, torch.Tensor) else self.weighted

    def comparable(self, other: Digest) -> bool:
        """Taken of as many values, in the same place (both on the CPU, read or not, or both on one device)?"""
        return self.numel == other.numel and self._place() == other._place()

    def _place(self) -> torch.device:
        return torch.device("cpu") if self.stats is None else self.stats[0].device


def _digestible(t: torch.Tensor) -> bool:
    return (
        type(t) in PLAIN_TENSORS
        and t.layout == torch.strided
        and not t.is_meta
        and not t.is_quantized
        and t.numel() > 0
    )


def _read_at_once(t: torch.Tensor) -> bool:
    """A plain float32 or float64 tensor on the CPU, with values: the common case, digested by :func:`_on_cpu`."""
    return t.dtype in _CPU_RTOL and t.is_cpu and _digestible(t)


def _quick(t: torch.Tensor) -> Digest | None:
    """The digest of a small contiguous float32 or float64 CPU tensor (not a lazy negative view)
    whose sum of squares keeps its dtype's precision, read through NumPy on its own memory: two
    dot products, no operator call and no grad mode to switch (see :func:`digest`), where the
    call is all there is. ``None`` for any other (:func:`_on_cpu` takes it through torch).

    This runs twice per call of a small block (its output, in the forward run and in the
    recomputation): each step is the cheapest that says it (no ``detach`` where nothing requires
    grad, torch's own C functions called directly)."""
    if type(t) not in PLAIN_TENSORS or not _NUMPY_WEIGHTS:
        return None
    dtype = t.dtype
    if dtype not in _CPU_RTOL or not t.is_cpu:
        return None
    n = t.numel()
    if not 0 < n <= _WEIGHTED_AT_MOST or t.layout != torch.strided or not t.is_contiguous() or t.is_neg():
        return None
    if _tracing_state():  # (a quantized tensor has a dtype of its own: not read here)
        return None
    v = (t.detach() if t.requires_grad else t).numpy().reshape(-1)
    if dtype is torch.float32:
        # The squares of float32 values, summed in float64, neither over- nor underflow (nor
        # are they a NaN but of one), nor do their products with the weights: NumPy has no
        # floating-point error to report there. Its cast does, of a signaling NaN (made from
        # bits, x.view(torch.float32)): an invalid operation, a warning by NumPy's default.
        with _numpy_errstate(invalid="ignore"):
            wide = v.astype("float64")
        squares = float(wide.dot(wide))
        if not _SQUARES_EXACT_FLOAT32 <= squares < _FLOAT32_MAX:
            return None
        # Weighted in float64 too: a float32 product of a tiny value (a subnormal) and a weight
        # underflows, which NumPy reports (np.seterr(all="raise") makes it raise); none does here.
        total = float(wide.dot(_NUMPY_WEIGHTS_FLOAT64[:n]))
        return Digest(None, n, _CPU_RTOL_FLOAT32, (total, math.sqrt(squares)), weighted_sum=True)
    with _numpy_errstate(over="ignore", invalid="ignore", under="ignore"):
        squares = float(v.dot(v))
        if not _SQUARES_EXACT[dtype] <= squares < math.inf:
            return None
        # (finite, of values whose squares are; a subnormal's product with a weight underflows)
        total = float(v.dot(_NUMPY_WEIGHTS_FLOAT64[:n]))
    return Digest(None, n, _CPU_RTOL[dtype], (total, math.sqrt(squares)), weighted_sum=True)


def _on_cpu(t: torch.Tensor) -> Digest:
    """:func:`_one` for a tensor :func:`_read_at_once` accepts, with none of its other cases.

    A small contiguous one (the host-bound case, where each operator's call is the cost) gets
    the position-weighted sum of all its values in place of their sum (:func:`_weighted`), read
    through NumPy where it can be (:func:`_quick`)."""
    quick = _quick(t)
    if quick is not None:
        return quick
    n = t.numel()
    small = n <= _WEIGHTED_AT_MOST and not torch._C._get_tracing_state()
    if small:
        # (Where NumPy cannot read it, z.conj().imag of one element, or its sum of squares left the
        # range its dtype holds to full precision: torch's norm scales the values, a plain sum of
        # squares under- or overflows; or not contiguous, a transposed output: its values in their
        # logical order, a copy of at most _WEIGHTED_AT_MOST of them, as a contiguous one reads them.)
        total = torch.dot(t.reshape(-1), _weights_for(n, t.dtype, _CPU_DEVICE)).item()  # (on the CPU: no device object to make)
        norm = torch.linalg.vector_norm(t).item()
    else:
        total = torch.sum(t).item()
        norm = torch.linalg.vector_norm(t).item()
    if t.dtype is torch.float32 and not (math.isfinite(total) and math.isfinite(norm)):
        return _one(t)  # overflowed float32 (see _one)
    if small:
        return Digest(None, n, _CPU_RTOL[t.dtype], (total, norm), weighted_sum=True)
    weighted, sampled = _weighted(t, t.dtype)
    return Digest(None, n, _CPU_RTOL[t.dtype], (total, norm), weighted=(None if weighted is None else weighted.item(), sampled))


#: Values the position-weighted sum reads at most: a larger output's are sampled with a stride.
_WEIGHTED_AT_MOST = 4096


def _weighted(v: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor | None, int]:
    """``sum(w_i * v_i)`` over ``v``'s values in their logical (row-major) order, whatever its layout
    (a strided sample of at most :data:`_WEIGHTED_AT_MOST` of them), in dtype ``acc``, and how many
    values it read.

    The weights (:func:`_weights`) are fixed and vary with the position. The sum and the norm do
    not change when values move (a roll or a permutation by a counter) or when they change while
    keeping both (a LayerNorm's output, whose rows keep sum 0 and norm sqrt(n) whatever its
    input); this does. Of the logical order, not the memory's: a transposed or strided output, and
    one a run lays out otherwise than the other, read alike (a tensor not contiguous is sampled by
    ``torch.take``, never copied whole). ``None`` under a dispatch mode (the weights would be made
    under it).
    """
    if dispatch_modes_active() or torch._C._get_tracing_state():
        return None, 0  # (torch.jit.trace: the weights, made once, would be a traced value of one trace)
    n = v.numel()
    step = -(-n // _WEIGHTED_AT_MOST)
    if v.is_contiguous():
        flat = v.view(-1)
        if step > 1:
            flat = flat[::step]
    elif step == 1:
        flat = v.reshape(-1)  # (a copy of at most _WEIGHTED_AT_MOST values)
    else:
        flat = torch.take(v, _sample_index(n, step, v.device))
    if flat.dtype is not acc:
        flat = flat.to(acc)
    return torch.dot(flat, _weights_for(flat.numel(), acc, flat.device)), flat.numel()


def _make_weights(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``1 + sin(i * golden ratio) / 2`` for ``i`` < :data:`_WEIGHTED_AT_MOST`: in [0.5, 1.5], positive
    (a change of all values alike changes their weighted sum, as it does their sum), unlike at every position."""
    with torch.inference_mode(False), torch.no_grad():
        w = torch.arange(_WEIGHTED_AT_MOST, dtype=torch.float64, device=device) * 1.6180339887498949
        return w.sin_().mul_(0.5).add_(1).to(dtype)


_CPU_DEVICE = torch.device("cpu")
#: The weights, made once per dtype and device (for the CPU's two at import: 48 KB).
_weights_made: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {
    (dtype, _CPU_DEVICE): _make_weights(dtype, _CPU_DEVICE) for dtype in (torch.float32, torch.float64)
}


def _weights(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    w = _weights_made.get((dtype, device))
    if w is None:
        w = _weights_made[(dtype, device)] = _make_weights(dtype, device)
    return w


_weights_of_length: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
_sample_indices: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _sample_index(n: int, step: int, device: torch.device) -> torch.Tensor:
    """The logical positions ``0, step, 2 step, ...`` below ``n`` that :func:`_weighted` samples of a
    large tensor that is not contiguous (kept, bounded as the weights are)."""
    key = (n, step, device)
    index = _sample_indices.get(key)
    if index is None:
        if len(_sample_indices) >= 64:
            _sample_indices.pop(next(iter(_sample_indices)))
        with torch.inference_mode(False), torch.no_grad():
            index = _sample_indices[key] = torch.arange(0, n, step, device=device)
    return index


def _numpy_weights() -> tuple[dict[torch.dtype, Any], Any]:
    """The CPU weights as NumPy arrays (sharing their memory), and NumPy's ``errstate``; or nothing
    where torch has no NumPy."""
    try:
        weights = {dtype: w.numpy() for (dtype, _), w in _weights_made.items()}
        import numpy

        return weights, numpy.errstate
    except (ImportError, RuntimeError):  # ("Numpy is not available": torch runs without it)
        return {}, None


_NUMPY_WEIGHTS, _numpy_errstate = _numpy_weights()
_FLOAT32_MAX = torch.finfo(torch.float32).max
#: A sum of squares at least this large keeps its dtype's precision: squares that fell below the
#: normal range (subnormal, or zero) lose at most a relative ``eps`` of it together.
_SQUARES_EXACT = {dtype: torch.finfo(dtype).tiny / torch.finfo(dtype).eps for dtype in (torch.float32, torch.float64)}
_SQUARES_EXACT_FLOAT32 = _SQUARES_EXACT[torch.float32]
_CPU_RTOL_FLOAT32 = _CPU_RTOL[torch.float32]
_NUMPY_WEIGHTS_FLOAT64: Any = _NUMPY_WEIGHTS.get(torch.float64)  # (None without NumPy: _quick asks first)
_tracing_state = torch._C._get_tracing_state


def _weights_for(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The first ``n`` weights (a view, kept: slicing is an operator call of its own)."""
    key = (n, dtype, device)
    w = _weights_of_length.get(key)
    if w is None:
        if len(_weights_of_length) >= 256:  # (bounded: outputs of many sizes)
            _weights_of_length.pop(next(iter(_weights_of_length)))
        w = _weights_of_length[key] = _weights(dtype, device)[:n]
    return w


#: Dtypes that ``std_mean`` reads as they are (on an accelerator); any other is converted first.
_MOMENTS_READ = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Bytes converted to the accumulation dtype at a time: the copy a conversion makes (twice a
#: 16-bit output's size in float32, eight times a boolean's in float64) stays 1 MiB, not a
#: multiple of the output, at the end of the forward run, where every earlier activation is alive.
_PIECE_BYTES = 1 << 20


def _one(b: torch.Tensor, batch_dims: int = 0) -> Digest:
    """The digest of one plain tensor, accumulated in at least float32 (integers exactly, in float64).

    ``batch_dims``: how many vmap batch dimensions lead ``b`` (the plain tensor under a vmap's
    wrappers, see :func:`_batch_first`)."""
    exact = not has_gradient_dtype(b)
    rtol = _RTOL_EXACT if exact else _RTOL.get(b.dtype, _RTOL_OTHER_FLOAT)
    numel = b.numel()
    v = b
    if v.is_complex():
        v = torch.view_as_real(v.resolve_conj())
        numel *= 2
    acc = torch.float64 if exact or v.dtype is torch.float64 else torch.float32
    if not b.is_cpu:
        pending = _weighted(v, acc)
        if v.dtype in _MOMENTS_READ:
            return Digest(torch.std_mean(v, correction=0), numel, rtol, moments=True, weighted=pending, batch_dims=batch_dims)
        return Digest(_sum_and_norm(v, acc), numel, rtol, weighted=pending, batch_dims=batch_dims)  # integers, booleans, 8-bit floats
    # Read now, unless a dispatch mode traces this run (linearize's make_fx): reading
    # a traced value would be a data-dependent operation. Such a digest is taken in
    # float64: it cannot be looked at to see whether float32 overflowed (below).
    if DEFER_ON_CPU or dispatch_modes_active():
        return Digest(_sum_and_norm(v, torch.float64), numel, rtol, weighted=_weighted(v, torch.float64), batch_dims=batch_dims)
    total, norm = (n.item() for n in _sum_and_norm(v, acc))
    if acc is not torch.float64 and not (math.isfinite(total) and math.isfinite(norm)):
        # The sum of squares overflows float32 for finite values beyond about 1e19 (1e16
        # for a million of them): both would then be inf, whatever the values, and the
        # comparison would see nothing. std_mean never overflowed there; float64 does not.
        total, norm = (n.item() for n in _sum_and_norm(v, torch.float64))
        acc = torch.float64
    weighted, sampled = _weighted(v, acc)
    return Digest(
        None, numel, rtol, (total, norm), weighted=(None if weighted is None else weighted.item(), sampled), batch_dims=batch_dims
    )


def _sum_and_norm(v: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and L2 norm of ``v``'s values in dtype ``acc``, converting :data:`_PIECE_BYTES` at a time."""
    if v.dtype is acc:
        return torch.sum(v), torch.linalg.vector_norm(v)
    piece = _PIECE_BYTES // acc.itemsize
    if v.numel() <= piece:
        c = v.to(acc)
        return torch.sum(c), torch.linalg.vector_norm(c)
    longest = max(range(v.dim()), key=v.size)
    sums, norms = [], []
    for part in torch.split(v, max(1, v.size(longest) * piece // v.numel()), dim=longest):
        c = part.to(acc)
        sums.append(torch.sum(c))
        norms.append(torch.linalg.vector_norm(c))
        del c  # before the next piece's copy: one alive at a time
    return torch.sum(torch.stack(sums)), torch.linalg.vector_norm(torch.stack(norms))


def digest(tensors: Sequence[torch.Tensor]) -> list[Digest | None]:
    """A :class:`Digest` of each tensor (``None`` where values cannot be compared: meta, sparse, subclasses).

    Taken of the plain tensor under any functorch wrapper, outside autograd,
    functorch and forward-mode AD, so it records nothing and costs one or two
    small reductions per output.
    """
    # (A torch-function mode on: an enclosing region's substitution mode, where a loop nested in its
    # run digests its steps. The digest's operators are funckpt's, not the function's to check.)
    read_now = _read_now()
    if read_now:
        # The common case, one small plain CPU output or a few: read through NumPy, which
        # records nothing (no grad mode to switch), or else as below.
        quick = [_quick(t) for t in tensors]
        if None not in quick:
            return quick
    modes = torch_function_mode_enabled()
    plain = not transforms_active() and forward_ad_level() < 0 and not modes
    grad_was = torch.is_grad_enabled()
    set_grad_enabled(False)  # no_grad without its Python frames
    try:
        if plain:  # the common case, without the contexts below
            return [_on_cpu(t) if read_now and _read_at_once(t) else _one(t) if _digestible(t) else None for t in tensors]
        with contextlib.ExitStack() as stack:
            if modes:
                stack.enter_context(torch._C.DisableTorchFunction())
            if transforms_active():
                stack.enter_context(DisableFuncTorch())
            if forward_ad_level() >= 0:
                stack.enter_context(set_fwd_grad_enabled(False))
            bottoms = [_batch_first(t) for t in tensors]
            return [_one(b, batch_dims) if _digestible(b) else None for b, batch_dims in bottoms]
    finally:
        set_grad_enabled(grad_was)


def _batch_first(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The plain tensor under ``t``'s functorch wrappers (as :func:`~funckpt._internals.bottom`), with
    the batch dimension of each vmap wrapping it moved to the front (the outermost vmap's first), and
    how many there are.

    Each vmap puts its batch dimension where its batching rules left it, and two runs of one function
    (its forward run and the recomputation) may leave it in different places; in front, the values of
    the two read in the same logical order, so the position-weighted sum compares them too."""
    batch: list[tuple[int, int]] = []  # (vmap level, its dimension in the tensor unwrapped so far)
    while is_functorch_wrapped(t):
        if is_batchedtensor(t):
            level, dim = maybe_get_level(t), maybe_get_bdim(t)
            batch = [(lv, d + (d >= dim)) for lv, d in batch]
            batch.append((level, dim))
        t = unwrap_one_level(t)
    if not batch:
        return t, 0
    front = [d for _, d in sorted(batch)]
    return t.permute(*front, *(d for d in range(t.dim()) if d not in front)), len(front)


def _read_now() -> bool:
    """Are CPU digests taken here read at once (:func:`_on_cpu`): no torch.func transform, forward-mode
    level, torch-function or dispatch mode on (a traced value cannot be read), none deferred?
    (The forward-mode level and the dispatch stack read directly, not through their one-line
    wrappers: this runs for every digest of a small output.)"""
    return not (
        DEFER_ON_CPU
        or transforms_active()
        or _fwAD._current_level >= 0
        or torch_function_mode_enabled()
        or _len_torch_dispatch_stack()
    )


_len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack


def reproduced(forward_meta: tuple[Any, ...], forward: Digest | None, recomputed: torch.Tensor) -> bool:
    """Does ``recomputed``, a recomputation's one output, pass both checks against the forward
    run's (its metadata, and its digest where ``forward`` is one)? Told at once for a small plain
    CPU output (see :func:`_quick`), the host-bound case; ``False`` means "not told here": the
    full checks (:func:`check_same_outputs`, :func:`check_same_values`) decide, and explain."""
    shape, dtype, device = forward_meta
    if recomputed.dtype is not dtype or recomputed.shape != shape or not recomputed.is_cpu or device.type != "cpu":
        return False
    if forward is None:
        return True
    if forward.values is None or not forward.weighted_sum or forward.weighted is not None:
        return False
    if not _read_now():
        return False
    b = _quick(recomputed)
    return b is not None and b.values is not None and b.numel == forward.numel and _agree(forward, forward.values, b.values, b)


def differing_digests(forward: Sequence[Digest | None], recomputed: Sequence[Digest | None]) -> list[int]:
    """Indices of the outputs whose digests differ beyond tolerance (one host sync on an accelerator)."""
    if len(forward) == 1 and len(recomputed) == 1:  # one output, both read (the common case)
        a, b = forward[0], recomputed[0]
        if (
            a is not None
            and b is not None
            and a.values is not None
            and b.values is not None
            and a.numel == b.numel
            and not isinstance(a.weighted, torch.Tensor)
            and not isinstance(b.weighted, torch.Tensor)
        ):
            return [] if _agree(a, a.values, b.values, b, a.weighted, b.weighted) else [0]
    pairs = [
        (i, a, b)
        for i, (a, b) in enumerate(zip(forward, recomputed))
        if a is not None and b is not None and a.comparable(b)
    ]
    if not pairs:
        return []
    # Digests not read yet (on an accelerator, or taken while a dispatch mode traced) are read at once.
    # One read per device (a host synchronisation on an accelerator), of every statistic pending there.
    on: dict[torch.device, list[torch.Tensor]] = {}
    for _, a, b in pairs:
        for d in (a, b):
            if d.values is None and d.stats is not None:
                on.setdefault(d.stats[0].device, []).extend(d.stats)
            if isinstance(d.weighted, torch.Tensor):
                on.setdefault(d.weighted.device, []).append(d.weighted)
    read: dict[int, float] = {}
    with torch.no_grad(), DisableFuncTorch():
        for stats in on.values():
            read.update(zip(map(id, stats), torch.stack(stats).cpu().tolist()))

    def sum_and_norm(d: Digest) -> tuple[float, float]:
        if d.values is not None:
            return d.values
        assert d.stats is not None
        first, second = (float(read[id(s)]) for s in d.stats)
        return d.from_stats(first, second)

    def weighted(d: Digest) -> float | None:
        return float(read[id(d.weighted)]) if isinstance(d.weighted, torch.Tensor) else d.weighted

    return [
        i for i, a, b in pairs if not _agree(a, sum_and_norm(a), sum_and_norm(b), b, weighted(a), weighted(b))
    ]


def _agree(
    a: Digest,
    forward: tuple[float, float],
    recomputed: tuple[float, float],
    b: Digest | None = None,
    weighted_f: float | None = None,
    weighted_r: float | None = None,
) -> bool:
    """Do the forward run's ``(sum, norm)`` and position-weighted sum and the recomputation's
    (digest ``b``) agree within ``a``'s tolerance?"""
    (sum_f, norm_f), (sum_r, norm_r) = forward, recomputed
    scale = max(abs(norm_f), abs(norm_r))
    # |sum(x) - sum(y)| <= sqrt(n) |x - y|_2: the sum gets sqrt(n) times the norm's tolerance;
    # a weighted sum, of m values with weights at most 1.5, 1.5 sqrt(m) times.
    checks = [(norm_f, norm_r, scale * a.rtol)]
    if b is None or a.weighted_sum == b.weighted_sum:  # (sums of one kind)
        checks.append((sum_f, sum_r, scale * a.rtol * a.numel**0.5 * (1.5 if a.weighted_sum else 1.0)))
    elif a.batch_dims == b.batch_dims:
        # One digest's sum is a position-weighted sum of all the values (a small output read at once,
        # see _on_cpu), the other's is not (the same output, taken under a transform: the recomputation
        # of a jacrev, under its vmap): it is compared with the other's weighted sum of them all.
        weighted_f, weighted_r = (sum_f, weighted_r) if a.weighted_sum else (weighted_f, sum_r)
        if (b.sampled if a.weighted_sum else a.sampled) != a.numel:
            weighted_f = None
    if (
        weighted_f is not None
        and weighted_r is not None
        and b is not None
        and (a.sampled == b.sampled or a.weighted_sum != b.weighted_sum)
        and a.batch_dims == b.batch_dims
    ):
        checks.append((weighted_f, weighted_r, 1.5 * scale * a.rtol * max(a.sampled, b.sampled, 1) ** 0.5))
    for f, r, tol in checks:
        if not (abs(f - r) <= tol or not (math.isfinite(f) or math.isfinite(r))):
            return False
    return True


_Check = tuple[
    str,
    Sequence["Digest | None"],
    Sequence["Digest | None"],
    "tuple[Sequence[str], Sequence[str]] | None",
    "int | None",
    bool,
    "int | None",  # (the loop's step, see check_same_values)
]


class _Pending:
    """The comparisons deferred to the end of one backward pass (one autograd graph task).

    Only the engine callbacks queued for them hold it. A backward pass that raises before
    its callbacks run drops them with its graph task, and this with them: its entry in
    ``_deferred`` (a weak dictionary) goes too, with the digests and traces it held.
    """

    __slots__ = ("__weakref__", "checks")

    def __init__(self) -> None:
        self.checks: list[_Check] = []


# Comparisons of digests on an accelerator, by autograd graph task, made at its end.
_deferred: weakref.WeakValueDictionary[int, _Pending] = weakref.WeakValueDictionary()
_deferred_lock = threading.Lock()
#: Keep CPU digests as tensors and defer their comparisons, as on an accelerator
#: (tests exercise the accelerator path with it).
DEFER_ON_CPU = False


def the_recomputation() -> str:
    """How an error names a recomputation: one runs in a backward pass, or in a forward-mode
    rule (``jvp``, ``jacfwd``), where no backward pass is running."""
    if current_graph_task_id() >= 0:
        return "the recomputation during the backward pass"
    return "the recomputation for forward-mode differentiation"


def rebound_error(who: str, function: str, t: torch.Tensor, instead: str, reached: Any = None) -> CheckpointError:
    """The error of a recomputation that used ``t``, a tensor ``function`` (as the message names it)
    did not reach at the call ``who`` made, or not where it reaches it now: a rebound closure
    variable, a reordered container. ``instead``: how to pass such tensors. ``reached``: what
    :func:`~funckpt._capture.changed_captures` found (its ``where`` and ``moved``), if known."""
    where = getattr(reached, "where", {}).get(id(t))
    if where is None:
        return CheckpointError(
            f"{who}: between the forward pass and its recomputation, {function} came to reach other "
            f"differentiable tensors than at the call, and used one (shape {tuple(t.shape)}): a closure "
            "variable, global or partial argument was rebound. The recomputation would use the new tensor "
            f"and the gradient would be wrong. {instead}, or do not rebind them before the backward pass."
        )
    if id(t) in getattr(reached, "of_modules", ()):
        return CheckpointError(
            f"{who}: between the forward pass and its recomputation, the module at {where!r}, which "
            f"{function} reaches, was replaced by another module it reached at the call elsewhere (a list, "
            "tuple or dict of modules reordered, or a plain object's modules swapped), and the recomputation "
            f"used one of its tensors (shape {tuple(t.shape)}). It would run it where the forward pass ran "
            "the other, and their gradients would go to the wrong parameters. Hold such modules in an "
            "nn.ModuleList or nn.ModuleDict (looked up by name again, as functional_call does), or do not "
            "reorder them before the backward pass."
        )
    if id(t) in getattr(reached, "moved", ()):
        return CheckpointError(
            f"{who}: between the forward pass and its recomputation, the tensor at {where!r}, which "
            f"{function} reaches, was replaced by another tensor it reached at the call elsewhere (a list or "
            "tuple reordered, reversed or sorted, an element inserted or removed before it, a dict value or "
            "attribute swapped, or a closure variable, global or partial argument rebound), and the "
            f"recomputation used it (shape {tuple(t.shape)}). It would compute with it where the forward pass "
            "used the other, and their gradients would go to the wrong tensors. "
            f"{instead}, or do not reorder or rebind them before the backward pass."
        )
    return CheckpointError(
        f"{who}: between the forward pass and its recomputation, the tensor at {where!r}, which {function} "
        "reaches, was rebound to a tensor it did not reach at the call (a closure variable, global or "
        "partial argument rebound, an element of a list, tuple or dict replaced: to a constant, or to a "
        "tensor made inside a torch.func transform that has ended since), and the recomputation used it (shape "
        f"{tuple(t.shape)}). It would compute with it where the forward pass used the tensor there at the "
        f"call, whose gradient would be wrong or silently missing. {instead}, or do not rebind them before "
        "the backward pass."
    )


def check_same_values(
    name: str,
    forward: Sequence[Digest | None],
    recomputed: Sequence[Digest | None],
    traces: tuple[Sequence[str], Sequence[str]] | None,
    kept_from: int | None = None,
    frontier: bool = False,
    step: int | None = None,
) -> None:
    """Raise :class:`CheckpointError` if a recomputed output's values differ from the forward run's
    (``kept_from``: as for :func:`check_same_outputs`; ``frontier``: the digests are of the tensors
    the function's last calls read, whose recomputation was skipped, see ``_tail``; ``step``: they
    are of what step ``step`` of a checkpointed loop returned, the loop ``name``).

    On an accelerator, inside a backward pass, the comparison waits for the end of
    that backward: reading the digests is a host synchronisation, and one at the end
    costs nothing where one per recomputation would stall the device between
    kernels. The error is then raised by the backward call itself, as any other is.
    """
    if not DEFER_ON_CPU and _all_read(forward) and _all_read(recomputed):  # the common case: compare now
        _compare(name, forward, recomputed, traces, kept_from, frontier, step)
        return
    task = current_graph_task_id()
    on_device = any(d is not None and d.stats is not None and not d.stats[0].is_cpu for d in (*forward, *recomputed))
    if task >= 0 and (on_device or DEFER_ON_CPU):
        with _deferred_lock:
            pending = _deferred.get(task)
            if pending is None:
                pending = _deferred[task] = _Pending()
            pending.checks.append((name, forward, recomputed, traces, kept_from, frontier, step))
        # One callback per check: the first to run compares everything pending for this task
        # (one host synchronisation), the others find nothing; a check deferred after that
        # one ran (by a later callback) still has its own.
        queue_engine_callback(lambda: _check_deferred(task, pending))
        return
    _compare(name, forward, recomputed, traces, kept_from, frontier, step)


def _all_read(digests: Sequence[Digest | None]) -> bool:
    for d in digests:
        if d is not None and d.values is None:
            return False
    return True


def _check_deferred(task: int, pending: _Pending) -> None:
    with _deferred_lock:
        checks, pending.checks = pending.checks, []
        if _deferred.get(task) is pending:
            del _deferred[task]
    for check in checks:
        _compare(*check)


def _compare(
    name: str,
    forward: Sequence[Digest | None],
    recomputed: Sequence[Digest | None],
    traces: tuple[Sequence[str], Sequence[str]] | None,
    kept_from: int | None = None,
    frontier: bool = False,
    step: int | None = None,
) -> None:
    differing = differing_digests(forward, recomputed)
    if not differing:
        return
    i = differing[0]
    a, b = forward[i], recomputed[i]
    assert a is not None and b is not None
    (s_f, n_f), (s_r, n_r) = a.read(), b.read()
    w_f, w_r = a.read_weighted(), b.read_weighted()
    if w_f is not None and w_r is not None:
        weighted = f", position-weighted sum {w_f:.6g} in the forward pass and {w_r:.6g} in the recomputation"
    elif a.weighted_sum != b.weighted_sum and (w_f if b.weighted_sum else w_r) is not None:
        # (one run's sum is its weighted sum, see _agree: the other's said beside it)
        weighted = f", position-weighted sum {w_f if b.weighted_sum else w_r:.6g} in the {'forward pass' if b.weighted_sum else 'recomputation'}"
    else:
        weighted = ""
    total_f, total_r = ("position-weighted sum" if d.weighted_sum else "sum" for d in (a, b))
    # A loop's step (its determinism_check and debug are remat's options: a loop takes neither).
    head = f"remat({name}): {the_recomputation()}" if step is None else f"{name}: step {step}, run again in the backward pass,"
    message = (
        f"{head} did not reproduce the forward pass: "
        f"{'an intermediate tensor its last operations read' if frontier else _output_words(i, kept_from)} has other values ({total_f} {s_f:.6g}, norm {n_f:.6g} in the forward pass; "
        f"{total_r} {s_r:.6g}, norm {n_r:.6g} in the recomputation{weighted})"
        + (f", and {len(differing) - 1} more {'tensor' if frontier else 'output'}(s) differ" if len(differing) > 1 else "")
        + ". The gradient would be that of another computation. The function must compute the same "
        "thing when called again with the same inputs: it may depend on state that changed between the "
        "forward and the backward pass (a counter, an iterator, a global, a module attribute; one set for "
        "the forward pass only, as diffusers' cross_attention_kwargs={'scale': s} scales PEFT's LoRA "
        "layers while the model's forward runs: set it for the whole step instead, set_adapters(..., "
        "weights=[s]); a module that rebuilds part of itself on its first call, as HF BigBird switches "
        "its attention type: call it once under torch.no_grad() first), read an input that was modified in place after the call, "
        "or draw random numbers from a generator remat cannot see (pass it as an argument; the global "
        "generators of numpy and of Python's random module are not replayed: HF's wav2vec2-family "
        "models draw their SpecAugment masks from numpy in training mode, so remat their encoder layers, "
        "not the whole model)."
        + (KEPT_HINT if kept_from is not None and any(j >= kept_from for j in differing) else "")
        + (" Pass determinism_check='none' to skip this check." if step is None else "")
    )
    raise CheckpointError(_with_traces(message, traces) if step is None else message)
