"""Dropout's masks, drawn as the function without remat draws them at the call.

torch has two kernels for ``dropout`` and ``alpha_dropout`` (and their in-place forms):

* ATen's (``aten/src/ATen/native/Dropout.cpp``, ``_dropout_impl``) fills
  ``at::empty_like(input)`` with ``bernoulli_``: the noise takes the input's strides, and
  the CPU kernel draws it in memory order;
* functorch's (``aten/src/ATen/functorch/PyTorchOperatorHacks.cpp``, ``dropout_hack``),
  registered at functorch's front dispatch key, draws ``at::bernoulli`` of
  ``at::empty({}).expand(input.sizes())``: a contiguous noise, in row-major order whatever
  the input's layout. It runs whenever a torch.func transform is active, for plain
  tensors too.

For a non-contiguous input (a transposed ``conv1d`` output, ``nn.MultiheadAttention``'s
batch-first output, a channels-last activation) the two masks are different permutations
of one random stream. (Where both call the fused ``native_dropout``, a CUDA ``dropout``,
they agree; ``feature_dropout`` draws contiguous noise both ways; torch's other random
operators are the same kernel with or without transforms.)

A remat'd call runs ``fn`` where the caller's transforms are not all active: one level
lower (its forward run and backward under a single ``torch.func.grad`` have no transform
left), or under a transform of its own (``jacrev``'s recomputation, under a fresh
``torch.func.vjp``, for a call made under plain autograd). There such a dropout would draw
another mask than the function without remat at the call: other values and gradients, or
a recomputation that does not reproduce the forward run (a false ``CheckpointError``).

So a region notes at the call which kernel the call's dropout takes
(:func:`functorch_at_the_call`), each run of its function says so while it runs
(:func:`enter_run`, :class:`Drawing`), and a dropout the user's code calls at the run's own
depth, where the kernel in force differs, runs as the call's kernel (:func:`redrawn`): the
same operators in the same order, in Python, so the same values and the same graph. The forward run's substitution
mode asks every such call; a recomputation without that mode gets a mode of its own only
where the forward run saw a dropout whose mask depends on the layout (:func:`layout_draw`)
and the kernels differ, so the common recomputation pays nothing per operator. A dropout
called from inside a C++ operator (``scaled_dot_product_attention``'s) is out of reach; its
input is a fresh matmul's output there, contiguous, whose mask both kernels draw alike.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._internals import functorch_depth, functorch_kernels_now, privateuse1_backend_name

__all__ = [
    "Draw",
    "Drawing",
    "LAYOUT_DRAWS",
    "Redraw",
    "differs_here",
    "enter_run",
    "functorch_at_the_call",
    "layout_draw",
    "leave_run",
    "redrawn",
]


class _Runs(threading.local):
    def __init__(self) -> None:
        # Per run of a user's function in progress, innermost last: does its call take
        # functorch's dropout kernel, and the transform depth the run executes the function at.
        self.stack: list[tuple[bool, int]] = []


_runs = _Runs()


def functorch_at_the_call() -> bool:
    """Would a dropout called here take functorch's kernel in the program without remat?

    In a run of a remat'd function at the depth the run executes it at, the run's call
    decides; deeper (the function entered a transform of its own), or outside any run, the
    kernel in force here does.
    """
    stack = _runs.stack
    if stack:
        functorch, depth = stack[-1]
        if functorch_depth() == depth:
            return functorch
    return functorch_kernels_now()


def differs_here(functorch: bool) -> bool:
    """Does the kernel in force here differ from the one a call that takes ``functorch``'s would take?"""
    return functorch != functorch_kernels_now()


def enter_run(functorch: bool) -> None:
    """A run of a region's function starts here, for a call that takes functorch's kernel or not
    (``functorch``): until :func:`leave_run`, its dropouts draw as at that call."""
    _runs.stack.append((functorch, functorch_depth()))


def leave_run(*exc: Any) -> None:
    _runs.stack.pop()


def in_a_run() -> bool:
    """Is a run of a region's function in progress on this thread (what runs now is nested in it)?"""
    return bool(_runs.stack)


class Drawing:
    """A run of a region's function (:func:`enter_run` to :func:`leave_run`) whose dropouts draw as at
    its call (``functorch``: whether the call takes functorch's kernel). ``intercept``: with
    :class:`Redraw` around it, for a run without the substitution mode (which redraws otherwise)."""

    __slots__ = ("functorch", "mode")

    def __init__(self, functorch: bool, intercept: bool) -> None:
        self.functorch = functorch
        self.mode = Redraw() if intercept else None

    def __enter__(self) -> None:
        enter_run(self.functorch)
        if self.mode is not None:
            try:
                self.mode.__enter__()  # type: ignore[no-untyped-call]  # (torch's untyped mode)
            except BaseException:
                leave_run()
                raise

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.mode is not None:
                self.mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            leave_run()


class Redraw(TorchFunctionMode):
    """Runs each dropout whose mask depends on the layout with its call's kernel (:func:`redrawn`)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in LAYOUT_DRAWS:
            draw = layout_draw(func, args, kwargs)
            run = None if draw is None else redrawn(draw)
            if run is not None:
                return run()
        return func(*args, **kwargs)


# ------------------------------------------------------------------ the calls concerned


@dataclass(frozen=True)
class Draw:
    """A dropout call whose mask depends on the input's layout, its arguments bound."""

    input: torch.Tensor
    p: float
    inplace: bool
    alpha: bool


_Bound = tuple[Any, Any, Any, Any]  # (input, p, train, inplace)


def _functional(input: Any, p: Any = 0.5, training: Any = True, inplace: Any = False) -> _Bound:
    return input, p, training, inplace


def _functional_alpha(input: Any, p: Any = 0.5, training: Any = False, inplace: Any = False) -> _Bound:
    return input, p, training, inplace


def _builtin(input: Any, p: Any, train: Any) -> _Bound:
    return input, p, train, False


def _builtin_in_place(input: Any, p: Any, train: Any) -> _Bound:
    return input, p, train, True


#: The torch functions that reach ATen's ``dropout``/``alpha_dropout`` (in place or not), as a
#: torch-function mode receives them: each with how its arguments bind and whether it is alpha
#: dropout. (``nn.Dropout`` and ``nn.AlphaDropout`` call the ``torch.nn.functional`` ones.)
LAYOUT_DRAWS: dict[Any, tuple[Callable[..., _Bound], bool]] = {
    F.dropout: (_functional, False),
    F.alpha_dropout: (_functional_alpha, True),
    torch.dropout: (_builtin, False),
    torch.dropout_: (_builtin_in_place, False),
    torch.alpha_dropout: (_builtin, True),
    torch.alpha_dropout_: (_builtin_in_place, True),
}

#: The devices where both kernels call the fused ``native_dropout`` for ``dropout`` (ATen's
#: ``is_fused_kernel_acceptable``, which functorch's copy keeps), with the ``privateuse1`` backend's.
_FUSED = frozenset({"cuda", "xpu", "lazy"})


def layout_draw(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Draw | None:
    """``func(*args, **kwargs)`` (a function of :data:`LAYOUT_DRAWS`) as a :class:`Draw`, if the two
    kernels would draw it differently: in training, with ``0 < p < 1``, on a non-contiguous
    strided input, not by the fused kernel. ``None`` otherwise (torch raises for bad arguments)."""
    bind, alpha = LAYOUT_DRAWS[func]
    try:
        input, p, train, inplace = bind(*args, **kwargs)
        if not (isinstance(input, torch.Tensor) and train):
            return None
        p = float(p)
        if not 0 < p < 1 or input.layout != torch.strided or input.numel() == 0 or input.is_contiguous():
            return None
    except (TypeError, ValueError, RuntimeError):  # (bad arguments; a tensor that cannot tell its layout)
        return None
    if not alpha and not inplace and (input.device.type in _FUSED or input.device.type == privateuse1_backend_name()):
        return None
    return Draw(input, p, bool(inplace), alpha)


def redrawn(draw: Draw) -> Callable[[], torch.Tensor] | None:
    """``draw`` computed by the kernel its call takes, where that differs from the one in force here."""
    functorch = functorch_at_the_call()
    if not differs_here(functorch):
        return None
    noise = _functorch_noise if functorch else _aten_noise
    return lambda: _apply_noise(draw, noise(draw))


def _functorch_noise(draw: Draw) -> torch.Tensor:
    """functorch's: ``at::bernoulli(at::empty({}, input.options()).expand(input.sizes()), 1 - p)``."""
    input = draw.input
    empty = torch.empty((), dtype=input.dtype, device=input.device).expand(input.shape)
    return torch.bernoulli(empty, 1 - draw.p)


def _aten_noise(draw: Draw) -> torch.Tensor:
    """ATen's: ``at::empty_like(input)`` (the input's strides) filled by ``bernoulli_(1 - p)``."""
    return torch.empty_like(draw.input).bernoulli_(1 - draw.p)


_SELU_ALPHA = 1.7580993408473766  # (ATen's constant for alpha dropout)
_ops = torch.ops.aten


def _apply_noise(draw: Draw, noise: torch.Tensor) -> torch.Tensor:
    """The rest of both kernels (the same code): scale the noise and apply it to the input.

    With the ``Scalar`` overloads C++ calls (Python's ``noise.div_(0.5)`` would call
    ``div_.Tensor``): a policy's recorder, which matches a recomputation's operators with
    the forward run's, and the debug traces then see the very same operators.
    """
    input, p = draw.input, draw.p
    if draw.alpha:
        a = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
        b = _ops.add_.Scalar(_ops.mul_.Scalar(_ops.add.Scalar(noise, -1), _SELU_ALPHA * a), _SELU_ALPHA * a * p)
        _ops.mul_.Scalar(noise, a)
        return (input.mul_(noise) if draw.inplace else input.mul(noise)).add_(b)
    _ops.div_.Scalar(noise, 1 - p)
    return input.mul_(noise) if draw.inplace else input.mul(noise)
