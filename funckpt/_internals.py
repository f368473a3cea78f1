"""Every torch internal funckpt relies on, in one place, at the bottom of its import graph.

funckpt composes with ``torch.func`` from the inside: it reads the functorch
interpreter stack, unwraps and rewraps tensors between transform levels, and
applies its autograd Function through functorch's own entry point. None of that
is public API. Each private symbol is imported here once, with what it is for
and the torch version it has existed since; the rest of the package imports
these names (or the small predicates below) and nothing private from torch. A
torch upgrade that moves one breaks this module's import, in one place.

The project tests with torch 2.13 (and 2.14); ``pyproject.toml`` states the
oldest version it claims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as _fwAD

# --------------------------------------------------------------- functorch: levels
# torch._C._functorch: the C++ side of torch.func (torch >= 2.0).
_C: Any = torch._C._functorch

#: The innermost active transform's interpreter, or None outside torch.func.
peek_interpreter_stack = _C.peek_interpreter_stack
#: The kinds of transform level (Grad, Jvp, Vmap, Functionalize).
TransformType = _C.TransformType
#: Is ``t`` a functorch wrapper (GradTrackingTensor, BatchedTensor)?
is_functorch_wrapped = _C.is_functorch_wrapped_tensor
#: The tensor one level below a functorch wrapper.
unwrap_one_level = _C.get_unwrapped
#: Is ``t`` a BatchedTensor (vmap)? Its vmap level, if any.
is_batchedtensor = _C.is_batchedtensor
maybe_get_level = _C.maybe_get_level
#: A wrapper whose transform has returned (a ``vjp_fn`` called later), and its inner tensor.
is_dead_tensor_wrapper = _C.is_dead_tensor_wrapper
unwrap_if_dead = _C.unwrap_if_dead
#: Move a tensor out of / into a grad level, and out of / into a vmap level.
unwrap_for_grad = _C._unwrap_for_grad
wrap_for_grad = _C._wrap_for_grad
unwrap_batched = _C._unwrap_batched
add_batch_dim = _C._add_batch_dim

#: Runs the body with functorch's dispatch keys off: ops on plain tensors stay plain
#: even while transforms are active (torch >= 2.0).
DisableFuncTorch = torch._C._DisableFuncTorch

# torch._functorch (Python side, torch >= 2.1): how a custom autograd.Function is applied
# under the transforms, the interpreters' ``lower()`` context, single-level Functions.
from torch._functorch.autograd_function import custom_function_call  # noqa: E402, F401
from torch._functorch.pyfunctorch import GradInterpreter, JvpInterpreter, VmapInterpreter  # noqa: E402, F401
from torch._functorch.utils import enable_single_level_autograd_function  # noqa: E402, F401

#: An autograd.Function that lives at one functorch level only (torch >= 2.1).
SingleLevelFunction: Any = torch.autograd.function._SingleLevelFunction


def interpreter_stack() -> list[Any]:
    """The active transforms, outermost first (empty outside torch.func)."""
    return _C.get_interpreter_stack() or []


def transforms_active() -> bool:
    """Is any torch.func transform active?"""
    return bool(torch._C._are_functorch_transforms_active())


def level_kinds() -> set[Any]:
    return {i.key() for i in interpreter_stack()}


def vmap_active() -> bool:
    return TransformType.Vmap in level_kinds()


def grad_levels_active() -> bool:
    return TransformType.Grad in level_kinds()


def jvp_levels_active() -> bool:
    return TransformType.Jvp in level_kinds()


# ------------------------------------------------------------ forward-mode AD
#: The innermost plain ``forward_ad.dual_level`` (-1 outside one). Private since torch 1.10.
def forward_ad_level() -> int:
    return int(_fwAD._current_level)


#: Turn forward-mode AD on or off for the body (a custom Function's forward runs with it off).
set_fwd_grad_enabled = _fwAD._set_fwd_grad_enabled


def forward_mode_active() -> bool:
    """Is forward-mode AD (a functorch jvp level or a plain dual level) computing tangents here?"""
    return forward_ad_level() >= 0 or jvp_levels_active()


# ------------------------------------------------------------ autograd engine
def set_grad_enabled(enabled: bool) -> None:
    """Grad mode without a context manager's Python frame (hot path)."""
    torch._C._set_grad_enabled(enabled)


def graph_task_keeps_graph() -> bool:
    """Was the running backward called with ``retain_graph=True``? (torch >= 1.13)"""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def legacy_vmap_depth() -> int:
    """Nesting of autograd's own vmap mode (``torch.autograd.grad(..., is_grads_batched=True)``)."""
    depth = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    return int(depth)


def legacy_vmap_decrement() -> None:
    torch._C._vmapmode_decrement_nesting()


def legacy_vmap_increment() -> None:
    torch._C._vmapmode_increment_nesting()


# ------------------------------------------------------------ modules
#: Swap a module's tensors for others for the body, as torch.func.functional_call does
#: (torch >= 2.0; the ``stack_weights`` argument since 2.1).
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module  # noqa: E402, F401


def fsdp2_training_state(module: Any) -> str:
    """FSDP2's training state of a sharded module (``FORWARD``, ``PRE_BACKWARD``, ...)."""
    return str(module._get_fsdp_state()._training_state.name)


# ------------------------------------------------------------ torch.compile
def skip_code(code: Any) -> None:
    """Dynamo never compiles a frame of this code on its own (it may still inline it)."""
    from torch._dynamo.eval_frame import skip_code as _skip

    _skip(code)


def comptime(fn: Any) -> None:
    """Run ``fn(ctx)`` while Dynamo traces this point (torch >= 2.1)."""
    from torch._dynamo.comptime import comptime as _comptime

    _comptime(fn)


# ------------------------------------------------------------ operators
#: ATen operator overloads and their packets, for policies.
OpOverload: Any = torch._ops.OpOverload
OpOverloadPacket: Any = torch._ops.OpOverloadPacket


# ------------------------------------------------------------ tensors
def bottom(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers (what dispatch modes see)."""
    while is_functorch_wrapped(x):
        x = unwrap_one_level(x)
    return x


def storage_of(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage, or ``None`` for tensors without one (batched, functorch).

    The address of the storage object itself (``_cdata``), not of its data:
    empty and meta tensors all have a null data pointer but distinct storages.
    """
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
