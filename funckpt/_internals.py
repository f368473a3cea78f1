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

import collections
import functools
import inspect
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.autograd.forward_ad as _fwAD
from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback  # Dynamo's frame callback now
from torch.multiprocessing.reductions import StorageWeakRef
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode as _get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "AccumulateGrad",
    "global_forward_hooks",
    "CreationMeta",
    "get_creation_meta",
    "bind_forward_once",
    "torch_pytree_node",
    "torch_function_mode_enabled",
    "callers_function_modes",
    "FunctionModesBack",
    "module_trackers_off",
    "torch_function_modes",
    "has_gradient_dtype",
    "register_tensor_hook",
    "backward_names_no_inputs",
    "current_graph_task_id",
    "default_dtype_as_at_the_call",
    "queue_engine_callback",
    "DisableFuncTorch",
    "GradInterpreter",
    "JvpInterpreter",
    "OpOverload",
    "OpOverloadPacket",
    "SingleLevelFunction",
    "has_torch_function",
    "autograd_grad",
    "at_a_grad_level_of_its_own",
    "functorch_depth",
    "functorch_dispatches_first",
    "functorch_kernels_now",
    "set_single_level_function_allowed",
    "set_versions",
    "single_level_function_allowed",
    "StorageWeakRef",
    "TransformType",
    "VmapInterpreter",
    "add_batch_dim",
    "apply_function",
    "bottom",
    "clone_storage",
    "compiler_disable",
    "comptime",
    "custom_function_call",
    "define_operator",
    "forward_ad_level",
    "forward_mode_active",
    "func_jvp_nests",
    "fsdp2_training_state",
    "share_fsdp2_state",
    "grad_levels_active",
    "graph_task_keeps_graph",
    "interpreter_stack",
    "is_batchedtensor",
    "is_legacy_batchedtensor",
    "dispatch_modes_active",
    "graph_traced",
    "is_fake",
    "PLAIN_TENSORS",
    "outside_functorch",
    "is_dead_tensor_wrapper",
    "is_functorch_wrapped",
    "jvp_levels_active",
    "lowered",
    "call_with_own_hooks",
    "has_own_hooks",
    "legacy_vmap_decrement",
    "legacy_vmap_depth",
    "legacy_vmap_increment",
    "made_under_no_grad",
    "level_lift",
    "level_kinds",
    "make_dual",
    "maybe_get_bdim",
    "maybe_get_level",
    "peek_interpreter_stack",
    "parametrization_cache",
    "privateuse1_backend_name",
    "set_fwd_grad_enabled",
    "fwd_grad_enabled",
    "set_fwd_grad_mode",
    "sequence_nr",
    "set_grad_enabled",
    "skip_code",
    "storage_of",
    "storage_weak_ref",
    "storage_expired",
    "transforms_active",
    "script_optimized",
    "set_script_optimized",
    "unpack_dual",
    "unwrap_batched",
    "unwrap_for_grad",
    "unwrap_if_dead",
    "unwrap_one_level",
    "vmap_active",
    "wrap_for_grad",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")

# --------------------------------------------------------------- functorch: levels
# torch._C._functorch: the C++ side of torch.func (torch >= 2.0).
_C: Any = torch._C._functorch

#: The innermost active transform's interpreter, or None outside torch.func.
peek_interpreter_stack = _C.peek_interpreter_stack
#: The kinds of transform level (Grad, Jvp, Vmap, Functionalize).
TransformType = _C.TransformType
#: Is ``t`` a functorch wrapper (GradTrackingTensor, BatchedTensor)?
is_functorch_wrapped: Callable[[torch.Tensor], bool] = _C.is_functorch_wrapped_tensor
#: The tensor one level below a functorch wrapper.
unwrap_one_level: Callable[[torch.Tensor], torch.Tensor] = _C.get_unwrapped
#: Is ``t`` a BatchedTensor (vmap)? Its vmap level, if any.
is_batchedtensor: Callable[[torch.Tensor], bool] = _C.is_batchedtensor
#: Is ``t`` batched by autograd's own (legacy) vmap (``vectorize=True``, ``is_grads_batched=True``)?
is_legacy_batchedtensor: Callable[[torch.Tensor], bool] = _C.is_legacy_batchedtensor
maybe_get_level: Callable[[torch.Tensor], int] = _C.maybe_get_level
#: A BatchedTensor's batch dimension, in the tensor one level below it.
maybe_get_bdim: Callable[[torch.Tensor], int] = _C.maybe_get_bdim
#: A wrapper whose transform has returned (a ``vjp_fn`` called later), and its inner tensor.
is_dead_tensor_wrapper: Callable[[torch.Tensor], bool] = _C.is_dead_tensor_wrapper
unwrap_if_dead: Callable[[torch.Tensor], torch.Tensor] = _C.unwrap_if_dead
#: Move a tensor out of / into a grad level, and out of / into a vmap level.
unwrap_for_grad: Callable[[torch.Tensor, int], torch.Tensor] = _C._unwrap_for_grad
wrap_for_grad: Callable[[torch.Tensor, int], torch.Tensor] = _C._wrap_for_grad
unwrap_batched: Callable[[torch.Tensor, int], tuple[torch.Tensor, int | None]] = _C._unwrap_batched
add_batch_dim: Callable[[torch.Tensor, int, int], torch.Tensor] = _C._add_batch_dim

# ------------------------------------------------------------------ autograd: views
#: How autograd made a view (``MULTI_OUTPUT_NODE``: one of several an operator returned together,
#: whose grad_fn autograd cannot make again from its base once the base is written).
CreationMeta: Any = torch._C._autograd.CreationMeta
get_creation_meta: Callable[[torch.Tensor], Any] = torch._C._autograd._get_creation_meta

#: Runs the body with functorch's dispatch keys off: ops on plain tensors stay plain
#: even while transforms are active (torch >= 2.0).
DisableFuncTorch = torch._C._DisableFuncTorch

# torch._functorch (Python side, torch >= 2.1): how a custom autograd.Function is applied
# under the transforms, the interpreters' ``lower()`` context, single-level Functions.
from torch._functorch.autograd_function import custom_function_call  # noqa: E402, F401
from torch._functorch.pyfunctorch import GradInterpreter, JvpInterpreter, VmapInterpreter  # noqa: E402, F401
from torch._functorch.pyfunctorch import (  # noqa: E402
    temporarily_clear_interpreter_stack as outside_functorch,  # since 2.0: run a block with no transform active
)

class lowered:
    """``interpreter.lower()`` without its Python context managers: run the body one level down.

    torch's ``lower()`` (``pyfunctorch``) pops the interpreter off the stack and, for a
    grad (jvp) level entered under ``no_grad`` (forward grad off), turns grad mode
    (forward grad) off for the body, mirroring the C++ ``sendToNextInterpreter``. It
    builds that from ``contextlib`` generators, about 3 us per use; a remat'd call under
    ``torch.func.grad`` lowers twice (its forward and its backward). Same order: the
    mode is set, then the level popped; the level pushed back, then the mode restored.
    """

    __slots__ = ("interpreter", "mode_was", "saved")

    def __init__(self, interpreter: Any) -> None:
        self.interpreter = interpreter
        self.mode_was: bool | None = None  # grad (or forward grad) mode to restore, where lower() sets it
        self.saved: Any = None

    def __enter__(self) -> None:
        interpreter = self.interpreter
        if interpreter.key() == TransformType.Grad:
            if not interpreter._cptr.prevGradMode():
                self.mode_was = torch.is_grad_enabled()
                set_grad_enabled(False)
        elif interpreter.key() == TransformType.Jvp:
            if not interpreter._cptr.prevFwdGradMode():
                self.mode_was = fwd_grad_enabled()
                set_fwd_grad_mode(False)
        try:
            self.saved = _pop_layer()
        except BaseException:
            self._restore_mode()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            _push_layer(self.saved)
        finally:
            self._restore_mode()

    def _restore_mode(self) -> None:
        if self.mode_was is None:
            return
        if self.interpreter.key() == TransformType.Grad:
            set_grad_enabled(self.mode_was)
        else:
            set_fwd_grad_mode(self.mode_was)
        self.mode_was = None


_SAVED_HOOKS_REFUSED = (
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. Please open an issue with your use case."
)
_saved_hooks_refusal: Callable[[], str | None] = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message


def at_a_grad_level_of_its_own(
    run: Callable[[list[torch.Tensor]], Sequence[_T]], tensors: Sequence[torch.Tensor], primals: Sequence[int]
) -> tuple[_T, ...]:
    """``run`` of ``tensors`` at a fresh ``torch.func`` grad level, the tensors at ``primals`` requiring
    grad there; its outputs (tensors, or ``None``) come back out of the level, and the graph recorded
    at it is dropped.

    What ``torch.func.vjp(run', *primals, has_aux=True)`` does where its vjp function is dropped and
    ``run'`` returns its outputs as the aux (every tensor wrapped at the level, as ``torch.func.grad``
    wraps all its arguments; grad mode on; saved-tensor hooks refused, with vjp's message), from
    functorch's C primitives (torch >= 2.0): vjp's own Python (pytree maps and flattens of its
    arguments and outputs, its checks of the outputs, the vjp function's closure) costs about a
    fifth of a small remat'd call, which runs a forward run there on every call under ``grad(f)``
    whose function reads a module's parameter (see ``UserRegion._forward_run_at_a_grad_level``).
    """
    level = _C._grad_increment_nesting()
    grad_was = torch.is_grad_enabled()
    hooks_refused = _saved_hooks_refusal() is not None
    try:
        set_grad_enabled(True)
        if not hooks_refused:  # (already refused below a torch.func.grad or vjp: the common case)
            torch._C._autograd._saved_tensors_hooks_disable(_SAVED_HOOKS_REFUSED)
        inputs = [_C._wrap_for_grad(t, level) for t in tensors]
        allowed = _C.get_inplace_requires_grad_allowed()
        _C.set_inplace_requires_grad_allowed(True)  # (requires_grad_() at a level, as torch.func does)
        try:
            for i in primals:
                inputs[i].requires_grad_()
        finally:
            _C.set_inplace_requires_grad_allowed(allowed)
        outs = run(inputs)
        return tuple(o if o is None else _C._unwrap_for_grad(o, level) for o in outs)
    finally:
        if not hooks_refused:
            torch._C._autograd._saved_tensors_hooks_enable()
        set_grad_enabled(grad_was)
        _C._grad_decrement_nesting()


_pop_layer = torch._C._functorch.pop_dynamic_layer_stack
_push_layer = torch._C._functorch.push_dynamic_layer_stack


def level_lift(interpreter: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The interpreter's lift of a tensor to its level (what its ``process()`` applies to every argument)."""
    return cast("Callable[[torch.Tensor], torch.Tensor]", interpreter._cptr.lift)


#: An autograd.Function that lives at one functorch level only (torch >= 2.1).
SingleLevelFunction: Any = torch.autograd.function._SingleLevelFunction
#: Whether applying one is allowed now (what torch's ``enable_single_level_autograd_function`` sets).
single_level_function_allowed: Callable[[], bool] = _C.get_single_level_autograd_function_allowed
set_single_level_function_allowed: Callable[[bool], None] = _C.set_single_level_autograd_function_allowed


_FUNCTORCH_FRONT = torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode
_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def functorch_dispatches_first() -> bool:
    """Would a higher-order operator called now go to functorch's interpreter stack first?

    Its key is on (transforms are active and not disabled) and the one key above it
    that is not a fallthrough for such operators, ``make_fx``'s pre-dispatch tracing
    (``torch.export``), is off.
    """
    included = torch._C._dispatch_tls_local_include_set()
    return bool(
        included.has(_FUNCTORCH_FRONT)
        and not included.has(_PRE_DISPATCH)
        and not torch._C._dispatch_tls_local_exclude_set().has(_FUNCTORCH_FRONT)
    )


def functorch_kernels_now() -> bool:
    """Would an ATen operator called now reach functorch's front key (on, and not excluded)?

    That key is on while any torch.func transform is active, whatever the tensors, and
    functorch registers its own kernels for a few composite operators there (dropout's:
    see ``_draws``), which then replace ATen's even for plain tensors.
    """
    # (functorch includes the key with its first level and drops it with its last: outside
    # torch.func, the common case, it is not on, told without reading the key sets.)
    return bool(
        torch._C._are_functorch_transforms_active()
        and torch._C._dispatch_tls_local_include_set().has(_FUNCTORCH_FRONT)
        and not torch._C._dispatch_tls_local_exclude_set().has(_FUNCTORCH_FRONT)
    )


#: The device type of the out-of-tree backend registered as ``privateuse1`` ("privateuseone" until renamed).
privateuse1_backend_name: Callable[[], str] = torch._C._get_privateuse1_backend_name


def functorch_depth() -> int:
    """How many torch.func transforms are active: the innermost one's level (functorch numbers
    a level one more than the number of levels below it), 0 outside torch.func."""
    top = peek_interpreter_stack()
    return 0 if top is None else cast(int, top.level())


#: Would a call with these arguments go to a ``__torch_function__`` (a mode or a subclass)?
has_torch_function: Callable[[Any], bool] = torch._C._has_torch_function


def bind_forward_once(function: type[Any]) -> None:
    """Compute ``function.forward``'s signature once, not at every apply.

    torch 2.14's C++ ``Function.apply`` binds the arguments of each call to ``forward``'s
    signature (``autograd.function._bind_default_args``, for a Function with ``setup_context``),
    and ``inspect.signature`` reads a function's ``__signature__`` before computing one: 13
    against 8.6 us per apply of a small Function (earlier versions do not bind there).
    """
    forward = function.forward
    forward.__signature__ = inspect.signature(forward)


#: ``function.apply(*args)`` without its per-call ``inspect.signature(forward).bind``: the C++ entry point.
def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    # ignore: the stubs do not declare _C._FunctionBase.apply
    return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def interpreter_stack() -> list[Any]:
    """The active transforms, outermost first (empty outside torch.func)."""
    return _C.get_interpreter_stack() or []


#: Is any torch.func transform active? (torch's C function itself: asked several times per remat'd call.)
transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active

#: Does TorchScript's graph executor optimize the graphs it runs (thread-local; what
#: ``torch.jit.optimized_execution`` sets)? Its optimized graphs do not compose with torch.func: a
#: differentiable graph reads its inputs' ``.data`` (refused under vmap) and drops their
#: forward-mode tangents (a zero jvp), both only once the profiling executor has optimized the graph.
script_optimized: Callable[[], bool] = torch._C._get_graph_executor_optimize
set_script_optimized: Callable[[bool], None] = torch._C._set_graph_executor_optimize


def level_kinds() -> set[Any]:
    return {i.key() for i in interpreter_stack()}


def vmap_active() -> bool:
    return transforms_active() and TransformType.Vmap in level_kinds()  # (the C check first: asked per run)


def grad_levels_active() -> bool:
    return transforms_active() and TransformType.Grad in level_kinds()


def jvp_levels_active() -> bool:
    return transforms_active() and TransformType.Jvp in level_kinds()


# ------------------------------------------------------------ forward-mode AD
#: The innermost plain ``forward_ad.dual_level`` (-1 outside one). Private since torch 1.10.
def forward_ad_level() -> int:
    return int(_fwAD._current_level)


#: Turn forward-mode AD on or off for the body (a custom Function's forward runs with it off).
set_fwd_grad_enabled = _fwAD._set_fwd_grad_enabled
#: The same switch without its context object: read it, and set it (restore it yourself).
fwd_grad_enabled: Callable[[], bool] = torch._C._is_fwd_grad_enabled
set_fwd_grad_mode: Callable[[bool], None] = torch._C._set_fwd_grad_enabled


#: ``forward_ad.unpack_dual``, typed: ``(primal, tangent)`` of ``t`` at the innermost dual level.
def unpack_dual(t: torch.Tensor) -> _fwAD.UnpackedDualTensor:
    return cast(_fwAD.UnpackedDualTensor, _fwAD.unpack_dual(t))  # type: ignore[no-untyped-call]


#: ``forward_ad.make_dual``, typed: a dual tensor of ``t`` and ``tangent`` at the innermost dual level.
def make_dual(t: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    return cast(torch.Tensor, _fwAD.make_dual(t, tangent))  # type: ignore[no-untyped-call]


import torch._functorch.eager_transforms as _eager_transforms  # noqa: E402


def func_jvp_nests() -> bool:
    """Can ``torch.func.jvp`` run here, below every transform, inside the dual level in force?

    Plain forward-mode AD has one dual level. ``torch.func.jvp`` enters it when it is the
    outermost jvp (its private ``JVP_NESTING`` counter is 0) and, inside one, nests as a
    functorch level of its own: so below every transform, where a dual level is in force, it
    can run where that level is a ``torch.func.jvp``'s (the counter is positive: entered by a
    transform whose levels remat's recomputation runs below), not the user's own
    ``fwAD.dual_level``, inside which it raises "nested forward mode AD is not supported".
    """
    return _eager_transforms.JVP_NESTING > 0


def forward_mode_active() -> bool:
    """Is forward-mode AD (a functorch jvp level or a plain dual level) computing tangents here?"""
    return forward_ad_level() >= 0 or jvp_levels_active()


# ------------------------------------------------------------ autograd engine
def set_grad_enabled(enabled: bool) -> None:
    """Grad mode without a context manager's Python frame (hot path)."""
    torch._C._set_grad_enabled(enabled)


#: The sequence number the next autograd node created on this thread gets (torch >= 2.1).
sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
#: Set the version counters of ``tensors`` (shared with their views) to ``versions`` (torch >= 2.5
#: takes the two tuples; what torch.compile's functionalization uses to undo its own bumps).
set_versions: Callable[[tuple[torch.Tensor, ...], tuple[int, ...]], None] = torch._C._autograd._unsafe_set_version_counter
#: The type of the node that accumulates a leaf's gradient (its ``.variable`` is the leaf).
AccumulateGrad: type[Any] = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def graph_task_keeps_graph() -> bool:
    """Was the running backward called with ``retain_graph=True``? (torch >= 1.13)"""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


from torch.autograd.graph import _engine_run_backward  # noqa: E402  # torch >= 2.2


def autograd_grad(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    create_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, create_graph=create_graph)``.

    Where that call's Python has nothing to do (no torch-function mode or subclass to
    consult, every cotangent a tensor of its output's shape, complex where it is,
    no nested tensor), the engine is run directly, through the same function
    ``torch.autograd.grad`` ends in (it keeps torch's debug logging and the
    context stash for device threads); anywhere else ``torch.autograd.grad`` itself
    runs, with its checks and errors.
    """
    if (
        not inputs
        or has_torch_function((*outputs, *inputs))
        or any(
            g is None or o.shape != g.shape or o.is_nested or o.is_complex() != g.is_complex()
            for o, g in zip(outputs, grad_outputs, strict=True)
        )
    ):
        return tuple(
            torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, create_graph=create_graph)
        )
    return tuple(
        _engine_run_backward(
            tuple(outputs), tuple(grad_outputs), create_graph, create_graph, tuple(inputs), True, accumulate_grad=False
        )
    )


def user_saved_tensors_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The ``(pack, unpack)`` pair of the innermost ``torch.autograd.graph.saved_tensors_hooks``
    a user entered (``save_on_cpu``, ...), or ``None``.

    torch's own checkpoint pushes hooks of its own: from torch 2.14 they name the user's pair
    that was on top when they were pushed (``_user_hooks``); before, they name nothing, and
    what is under them is not this call's to pack through (``None``).
    """
    hooks: Any = _top_saved_tensors_hooks(False)
    while hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint":
        hooks = getattr(hooks[0], "_user_hooks", None)
    return None if hooks is None else (hooks[0], hooks[1])


def autograd_excluded() -> bool:
    """Is autograd excluded from dispatch on this thread (no operator records a graph, whatever
    grad mode says)? So it is inside ``torch.inference_mode``, and one level below a torch.func
    level entered under it, where ``is_inference_mode_enabled()`` reads false."""
    return bool(torch._C._dispatch_tls_is_dispatch_key_excluded(_AUTOGRAD_KEY))


_AUTOGRAD_KEY = torch._C.DispatchKey.AutogradFunctionality


class autograd_included:
    """Run the body with autograd dispatched to where :func:`autograd_excluded` says it is not
    (``torch.inference_mode(False)``, keeping grad mode and forward grad mode as they are, as
    functorch's own ``_disable_inference_mode`` does around a ``vjp_fn``); elsewhere, nothing."""

    __slots__ = ("guard",)

    def __enter__(self) -> None:
        self.guard = None
        if not autograd_excluded():
            return
        grad, forward_grad = torch.is_grad_enabled(), fwd_grad_enabled()
        self.guard = torch._C._InferenceMode(False)
        self.guard.__enter__()  # type: ignore[no-untyped-call]  # (torch's C guard, untyped)
        set_grad_enabled(grad)
        set_fwd_grad_mode(forward_grad)

    def __exit__(self, *exc: Any) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)  # (restores grad modes and dispatch keys as they were)


#: The innermost saved-tensor hooks pushed (a user's, or torch's checkpoint's own), or ``None``.
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _as_is(x: Any) -> Any:
    return x


def hide_saved_tensors_hooks() -> bool:
    """Where a user's ``saved_tensors_hooks`` are on (``save_on_cpu``, an activation offloader),
    push a pair that saves tensors as autograd does without hooks; return whether it did
    (then :func:`restore_saved_tensors_hooks` must follow).

    For a remat'd call's runs: the tensors their graphs save are the call's internals, which
    the user's hooks never see under ``torch.utils.checkpoint`` either (its own hooks take
    them); packed there, the forward run's would be copied away and never asked for again, and
    the recomputation's copied away and straight back.
    """
    if _top_saved_tensors_hooks(False) is None:
        return False
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # (in torch's C module, not its stubs)
        return False  # (disabled where they are on, as inside a torch.func transform: nothing to push)
    torch._C._autograd._push_saved_tensors_default_hooks(_as_is, _as_is)
    return True


def restore_saved_tensors_hooks(*_exc: Any) -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


def register_tensor_hook(t: torch.Tensor, hook: Callable[..., Any]) -> None:
    """``t.register_hook(hook)`` (untyped in torch's stubs)."""
    t.register_hook(hook)  # type: ignore[no-untyped-call]


# Where autograd registers a hook on a node (``grad_fn.register_hook``, ``register_prehook``; a
# module's full backward hooks too): torch's C++ ``registerFunctionHook`` looks this static method
# up on ``torch.autograd.Function`` at each registration (torch >= 2.0), and calls it with the node's
# dict of hooks of that kind (None for its first) and the hook; it returns the dict and the handle.
from torch.autograd.function import _HookMixin  # noqa: E402

register_node_hook: Callable[[Any, Callable[..., Any]], tuple[Any, Any]] = _HookMixin._register_hook


def route_node_hooks(route: Callable[[Any, Callable[..., Any]], tuple[Any, Any]]) -> None:
    """Have every hook registered on an autograd node go through ``route``, which takes and returns
    what :data:`register_node_hook` does (and calls it). Once, at import: a node is a C++ object whose
    methods cannot be wrapped, and no torch function sees its hooks registered."""
    _HookMixin._register_hook = staticmethod(route)  # type: ignore[method-assign]


def backward_names_no_inputs() -> bool:
    """Does the backward pass running now name no ``inputs`` (``.backward()``, not ``torch.autograd.grad``)?

    What ``torch.utils.checkpoint(..., use_reentrant=True)`` needs to run its backward.
    """
    return bool(torch.autograd._is_checkpoint_valid())  # type: ignore[no-untyped-call]


def dispatch_modes_active() -> bool:
    """Is any torch-dispatch mode active (``make_fx`` tracing, ``linearize``, FakeTensorMode, a user's)?"""
    return bool(torch._C._len_torch_dispatch_stack())


#: The types of a plain tensor (``type(t) in PLAIN_TENSORS``: no subclass, no FakeTensor), asked first
#: on the per-call paths, where a subclass takes a slower way.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_fake(t: torch.Tensor) -> bool:
    """Is ``t`` a FakeTensor (``FakeTensorMode``, ``make_fx(tracing_mode="fake")``): no memory, no values?"""
    return isinstance(t, _FakeTensor)


def graph_traced() -> bool:
    """Is ``make_fx``'s tracer recording the operators into a graph (``torch.func.linearize``,
    ``torch.export``, a user's ``make_fx``), pre-dispatch or not? (Not FakeTensorMode alone,
    a FlopCounterMode or a user's logging mode, under which the operators run as called.)"""
    return bool(torch._C._len_torch_dispatch_stack()) and _get_proxy_mode() is not None


#: Is any torch-function mode active (``with torch.device(...)`` is one)? (torch's C function itself.)
torch_function_mode_enabled: Callable[[], bool] = torch._C._is_torch_function_mode_enabled


def torch_function_modes() -> list[Any]:
    """The torch-function modes on now, innermost last (one being handled is off while its handler runs)."""
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def callers_function_modes() -> tuple[Any, ...]:
    """The torch-function modes on now but funckpt's own, outermost first: those the caller runs
    under (``with torch.device(...)``, ``torch.set_default_device``, a mode of the user's)."""
    if not torch._C._is_torch_function_mode_enabled():
        return ()
    return tuple(m for m in torch_function_modes() if not type(m).__module__.startswith("funckpt."))


class FunctionModesBack:
    """Puts ``modes`` (:func:`callers_function_modes` at a call) back on the torch-function mode stack
    where they are off, in order, and takes them off again on leaving.

    Pushed as they are, not entered: a mode's ``__enter__`` may do more than push it (a device
    context moves itself to the bottom of the stack; a user's mode may reset its own state), and
    the caller entered each once already.
    """

    __slots__ = ("modes", "pushed")

    def __init__(self, modes: Sequence[Any]) -> None:
        self.modes = modes
        self.pushed = 0

    def __enter__(self) -> None:
        on = {id(m) for m in torch_function_modes()} if torch._C._is_torch_function_mode_enabled() else set()
        for m in self.modes:
            if id(m) not in on:
                torch._C._push_on_torch_function_stack(m)
                self.pushed += 1

    def __exit__(self, *exc: Any) -> None:
        pushed, self.pushed = self.pushed, 0
        for _ in range(pushed):
            torch._C._pop_torch_function_stack()


def current_graph_task_id() -> int:
    """The id of the autograd graph task running now, -1 outside a backward pass (torch >= 2.0)."""
    return int(torch._C._current_graph_task_id())


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends; an exception it raises reaches the caller."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


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
import torch.nn.utils.parametrize as _parametrize  # noqa: E402


def parametrization_cache() -> dict[Any, torch.Tensor] | None:
    """The dict in which ``torch.nn.utils.parametrize.cached()`` keeps each parametrized
    tensor once computed (keyed by module and name), while it is on; ``None`` when off.
    (``_cache`` and ``_cache_enabled``: torch >= 1.9.)"""
    return cast("dict[Any, torch.Tensor]", _parametrize._cache) if _parametrize._cache_enabled else None


import torch.nn.modules.module as _module_module  # noqa: E402


class _WithoutGlobalHooks(dict):  # type: ignore[type-arg]
    """The globals ``nn.Module._call_impl`` reads, with the global hook registries empty.

    Holds only those; every other name is looked up in torch's module when read
    (``__missing__``), so what torch patches there later is still seen."""

    def __missing__(self, name: str) -> Any:
        return vars(_module_module)[name]  # (a KeyError falls through to the builtins)


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _without_global_hooks(*methods: Any) -> list[Callable[..., Any]]:
    """``nn.Module`` methods, torch's own code, run with globals where the hook registries are empty."""
    empty = _WithoutGlobalHooks()
    for name in set().union(*(_code_names(m.__code__) for m in methods)):
        value = vars(_module_module).get(name)
        if name.startswith("_global_") and isinstance(value, dict):
            empty[name] = type(value)()
    return [types.FunctionType(m.__code__, empty, m.__name__, m.__defaults__, m.__closure__) for m in methods]


#: ``nn.Module._call_impl``, torch's own code, seeing no global hooks (``register_module_forward_hook``...),
#: and the two methods it asks for the backward hooks, which add the global ones to the module's.
_call_impl_own_hooks, *_own_backward_hook_getters = _without_global_hooks(
    torch.nn.Module._call_impl, torch.nn.Module._get_backward_hooks, torch.nn.Module._get_backward_pre_hooks
)
_BACKWARD_HOOK_GETTERS = ("_get_backward_hooks", "_get_backward_pre_hooks")
_ABSENT = object()


def _call_with_own_attributes(module: Any, values: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """:data:`_call_impl_own_hooks` with the module's own attributes (which come before its
    class's methods) set to ``values`` for the call, and put back as they were after it."""
    own = module.__dict__
    before = {name: own.get(name, _ABSENT) for name in values}
    own.update(values)
    try:
        return _call_impl_own_hooks(module, *args, **kwargs)
    finally:
        for name, value in before.items():
            if value is _ABSENT:
                own.pop(name, None)
            else:
                own[name] = value


def call_with_own_hooks(
    module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], forward: Callable[..., Any] | None = None
) -> Any:
    """``module(*args, **kwargs)`` running the module's own hooks but not the global ones.

    For the module a ``remat`` wrapper wraps: the wrapper's own call, which torch runs
    with the global hooks, is this module's call for every hook that sees it (it
    poses as its class), and a global hook must not apply twice to one layer's call.
    ``forward``: what stands for the module's ``forward`` in a call that runs its own hooks
    (their ``_call_impl`` calls it), where the caller gives one.

    For a module with backward hooks of its own, where global ones are registered too:
    ``_call_impl`` asks the module for its backward hooks, and torch's methods add the global
    ones. For the call, the module's own attributes are those methods seeing no global hooks.
    """
    if module._compiled_call_impl is not None:  # (module.compile(): torch's compiled call, hooks and all)
        return module(*args, **kwargs)
    if not has_own_hooks(module):
        call = forward or (module._slow_forward if torch._C._get_tracing_state() else module.forward)
        return call(*args, **kwargs)
    values: dict[str, Any] = {} if forward is None else {"forward": forward}
    if (module._backward_hooks or module._backward_pre_hooks) and (
        _module_module._global_backward_hooks or _module_module._global_backward_pre_hooks
    ):
        for name, getter in zip(_BACKWARD_HOOK_GETTERS, _own_backward_hook_getters):
            values[name] = types.MethodType(getter, module)
    if values:
        return _call_with_own_attributes(module, values, args, kwargs)
    return _call_impl_own_hooks(module, *args, **kwargs)


def global_forward_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    """torch's global forward pre-hooks and forward hooks (``register_module_forward_pre_hook``,
    ``register_module_forward_hook``), the registries as they are now (a recomputation may run
    with copies of them in their places: see global_module_hooks_as_at_the_call)."""
    return _module_module._global_forward_pre_hooks, _module_module._global_forward_hooks


#: The registries of the global module hooks that ``nn.Module._call_impl`` reads at each module call
#: (``register_module_forward_hook``, ``register_module_full_backward_hook``, ...), and theirs of flags.
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")
_GLOBAL_HOOK_FLAGS = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")

#: The global module hooks at a call: a copy of each registry, and whether the backward hooks are full.
GlobalHooks = tuple[tuple[dict[int, Any], ...], Any]


def global_module_hooks_registered() -> bool:
    """Is any global module hook registered now?"""
    m = _module_module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_pre_hooks or m._global_backward_hooks)


def global_module_hooks_now() -> GlobalHooks | None:
    """The global module hooks registered now (``None`` where there is none: the common case)."""
    if not global_module_hooks_registered():
        return None
    m = _module_module
    return tuple(dict(getattr(m, name)) for name in (*_GLOBAL_HOOKS, *_GLOBAL_HOOK_FLAGS)), m._global_is_full_backward_hook


class default_dtype_as_at_the_call:
    """torch's default dtype set back to ``then``, the forward run's, while a recomputation runs.

    ``torch.set_default_dtype`` between the forward and the backward pass (a model built in float32
    after one trained in float64, a test that switches it) would otherwise have the recomputation's
    factory calls (``torch.ones``, ``linspace``, ``torch.tensor(0.5)``) make tensors of another dtype
    than the forward run's: other values, a false "did not reproduce" (a wrong gradient with the check
    off), where the function without remat computed its gradient from the forward run's. Entered only
    where it differs (see ``UserRegion._replays``). Process-wide, as the setting is.
    """

    __slots__ = ("saved", "then")

    def __init__(self, then: torch.dtype) -> None:
        self.then = then
        self.saved: torch.dtype | None = None

    def __enter__(self) -> None:
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.then)

    def __exit__(self, *exc: Any) -> None:
        saved, self.saved = self.saved, None
        if saved is not None:
            torch.set_default_dtype(saved)


class global_module_hooks_as_at_the_call:
    """Put torch's global module hooks back to those registered at the call (``then``:
    :func:`global_module_hooks_now`), for a recomputation.

    Without remat each module call inside the function runs the global forward hooks registered
    then, and takes the global full backward hooks and pre-hooks registered then (``BackwardHook``
    keeps the lists): removed between the forward and the backward pass they still run, registered
    in between they do not. A recomputation calls the modules again, and would take those registered
    in the backward pass: a gradient hook silently missing or one more, a forward hook that changes
    an output computing another one (a false "did not reproduce", a wrong gradient with the check off),
    as :class:`funckpt._capture.training_as_at_the_call` does for a module's own backward hooks.

    Where they differ (rare: nothing is done otherwise), torch's registries are copies of those at the
    call while the recomputation runs, and torch's own again on leaving (those the handles edit); a
    hook the function registers itself is registered in the copies, for the recomputation only.
    Process-wide, as the registries are: a module called in another thread meanwhile sees them too.
    """

    __slots__ = ("saved", "then")

    def __init__(self, then: GlobalHooks | None) -> None:
        self.then = then
        self.saved: tuple[list[Any], Any] | None = None

    def __enter__(self) -> None:
        m = _module_module
        then = self.then
        if then is None:
            if not global_module_hooks_registered():
                return
            registries: tuple[dict[int, Any], ...] = tuple({} for _ in (*_GLOBAL_HOOKS, *_GLOBAL_HOOK_FLAGS))
            full = m._global_is_full_backward_hook
        else:
            registries, full = then
            if all(getattr(m, name).keys() == hooks.keys() for name, hooks in zip(_GLOBAL_HOOKS, registries)):
                return  # (the same hooks as at the call)
        names = (*_GLOBAL_HOOKS, *_GLOBAL_HOOK_FLAGS)
        self.saved = [getattr(m, name) for name in names], m._global_is_full_backward_hook
        for name, hooks in zip(names, registries):
            setattr(m, name, collections.OrderedDict(hooks))
        m._global_is_full_backward_hook = full

    def __exit__(self, *exc: Any) -> None:
        saved, self.saved = self.saved, None
        if saved is not None:
            m = _module_module
            for name, hooks in zip((*_GLOBAL_HOOKS, *_GLOBAL_HOOK_FLAGS), saved[0]):
                setattr(m, name, hooks)
            m._global_is_full_backward_hook = saved[1]


#: The modules of torch's module trackers: ``ModuleTracker`` (which ``FlopCounterMode`` runs) and the
#: distributed tools' ``ModTracker`` (``MemTracker``, ``RuntimeEstimator``).
_TRACKERS = ("torch.utils.module_tracker", "torch.distributed._tools.mod_tracker")


def module_trackers_off() -> Callable[..., None] | None:
    """Take the global forward hooks of torch's module trackers off for one run of a remat'd
    function; return what puts them back (``None`` where none is registered).

    A tracker's hooks register ``register_multi_grad_hook`` on each module's inputs and outputs,
    only to know which module the backward pass is in. On a forward run's tensors (its own copies
    of the inputs, a graph it drops) they would never be called, and their handles, kept to the
    tracker's end, would hold that graph alive; on a recomputation's inputs, leaves differentiated
    by ``torch.autograd.grad``, torch refuses them. Off, the modules inside the function are counted
    as part of the remat'd call's module (or its caller's): what ``FlopCounterMode`` counts is the
    same, attributed one level up.

    Off in this thread only, and left in their places: the dictionaries are the process's, and
    another thread's modules (under its own tracker) still run them. Each is wrapped, while some
    thread's call runs, in a :class:`_TrackerHookOff` that skips it in the threads running a
    remat'd call; the last call to end unwraps it, unless its handle removed it meanwhile (the
    tracker exited): a hook taken out and put back would outlive its tracker.
    """
    dicts = global_forward_hooks()
    if not (dicts[0] or dicts[1]):
        return None
    with _TRACKER_HOOKS_LOCK:
        wrapped = []
        for hooks in dicts:
            for key, hook in list(hooks.items()):
                if not isinstance(hook, _TrackerHookOff):
                    if type(getattr(hook, "__self__", None)).__module__ not in _TRACKERS:
                        continue
                    hook = hooks[key] = _TrackerHookOff(hook)
                hook.users += 1
                wrapped.append((hooks, key, hook))
        if not wrapped:
            return None
    _trackers_off.depth = getattr(_trackers_off, "depth", 0) + 1

    def put_back(*_exc: Any) -> None:
        _trackers_off.depth -= 1
        with _TRACKER_HOOKS_LOCK:
            for hooks, key, hook in wrapped:
                hook.users -= 1
                if not hook.users and hooks.get(key) is hook:  # (in its place: the order is kept)
                    hooks[key] = hook.hook

    return put_back


#: How many remat'd calls this thread runs now, one inside another (see :func:`module_trackers_off`).
_trackers_off = threading.local()
_TRACKER_HOOKS_LOCK = threading.Lock()


class _TrackerHookOff:
    """A module tracker's global hook, skipped in a thread running a remat'd call."""

    __slots__ = ("hook", "users")

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook
        self.users = 0  # (the calls running now, in any thread, that wrapped it or found it wrapped)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_trackers_off, "depth", 0):
            return None
        return self.hook(*args, **kwargs)


def has_own_hooks(module: Any) -> bool:
    """Does ``module`` have forward or backward hooks of its own (not the global ones)?"""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)


def fsdp2_training_state(module: Any) -> str:
    """FSDP2's training state of a sharded module (``FORWARD``, ``PRE_BACKWARD``, ...)."""
    return str(module._get_fsdp_state()._training_state.name)


def share_fsdp2_state(wrapper: torch.nn.Module, module: torch.nn.Module) -> None:
    """Register FSDP2's state of ``module`` as ``wrapper``'s too: ``fully_shard`` of a model then
    takes the wrapper for the sharded module it stands for (its parameters, the module's, are
    the module's to shard), and does not try to shard them again as its own."""
    from torch.distributed._composable_state import _get_module_state, _insert_module_state

    state = _get_module_state(module)
    if state is not None and _get_module_state(wrapper) is None:
        _insert_module_state(wrapper, state)


# ------------------------------------------------------------ pytrees
import torch.utils._pytree as _torch_pytree  # noqa: E402


def torch_pytree_node(kind: type) -> tuple[Callable[[Any], tuple[list[Any], Any]], Callable[[Any, Any], Any]] | None:
    """How torch's own pytree flattens and rebuilds ``kind`` (``flatten(obj) -> (children, context)``,
    ``unflatten(children, context)``), if a library registered it there (transformers' ``ModelOutput``
    classes, for one); ``None`` otherwise. (``SUPPORTED_NODES``: torch >= 2.0.)"""
    node = _torch_pytree.SUPPORTED_NODES.get(kind)
    return None if node is None else (node.flatten_fn, node.unflatten_fn)


def class_forward(module: torch.nn.Module) -> Any:
    """``type(module).forward``: the forward its class defines. A TorchScript module's class
    (``RecursiveScriptModule``, from ``torch.jit.script`` or ``torch.jit.trace``) holds a descriptor
    that reads the forward off an instance and raises on the class; its raw descriptor then."""
    try:
        return type(module).forward
    except AttributeError:
        return inspect.getattr_static(type(module), "forward", None)


# ------------------------------------------------------------ torch.compile
def exporting() -> bool:
    """Is ``torch.export`` tracing (strict or not)? Read from torch's own flag where it has one:
    torch 2.11's Dynamo folds ``torch.compiler.is_exporting()`` to ``True`` in every function it
    compiles, ``torch.compile``'s included; the flag it reads is set by ``torch.export`` alone."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def skip_code(code: Any) -> None:
    """Dynamo never compiles a frame of this code on its own (it may still inline it)."""
    from torch._dynamo.eval_frame import skip_code as _skip

    _skip(code)


def comptime(fn: Any) -> None:
    """Run ``fn(ctx)`` while Dynamo traces this point (torch >= 2.1)."""
    from torch._dynamo.comptime import comptime as _comptime

    _comptime(fn)


def compiler_disable(reason: str) -> Callable[[_F], _F]:
    """``torch.compiler.disable``, typed: a decorator that keeps Dynamo from tracing a function.

    The function it returns enters ``torch.compiler.disable``'s wrapper only where
    Dynamo could see the call: while it traces (``is_compiling()``, which Dynamo reads
    as a constant, so it traces the disabled branch alone) or while its frame
    callback is set (eager code a compiled function runs, after a graph break,
    whose callees it would otherwise compile). Elsewhere the wrapper, a few frame
    evaluator swaps, would do nothing at a cost paid on every remat'd call.
    """
    try:
        disable = cast("Callable[[_F], _F]", torch.compiler.disable(reason=reason))  # type: ignore[no-untyped-call]
    except TypeError:  # torch < 2.8: no reason argument
        disable = cast("Callable[[_F], _F]", torch.compiler.disable)

    def decorate(fn: _F) -> _F:
        disabled = disable(fn)

        @functools.wraps(fn)
        def eager_unless_compiling(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or eval_frame_callback() is not None:
                return disabled(*args, **kwargs)
            return fn(*args, **kwargs)

        skip_code(eager_unless_compiling.__code__)  # type: ignore[attr-defined]
        return cast(_F, eager_unless_compiling)

    return decorate


#: ``StorageWeakRef(storage)``, typed: a weak, hashable handle on a storage (equal for the same storage).
def storage_weak_ref(storage: torch.UntypedStorage) -> StorageWeakRef:
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def storage_expired(ref: StorageWeakRef) -> bool:
    """Is the storage ``ref`` (:func:`storage_weak_ref`) handles freed?"""
    return bool(ref.expired())  # type: ignore[no-untyped-call]





class DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's untyped __init_subclass__
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` enters ``torch.compiler.disable``'s
    wrapper only where Dynamo could see the call (see :func:`compiler_disable`).

    torch wraps every mode's ``__torch_dispatch__`` in ``torch._dynamo.disable`` (two Python
    frames, three frame-evaluator swaps and an ``is_exporting()`` per operator), so that Dynamo
    does not compile the mode's frames where a compiled function's eager code runs under it.
    funckpt's modes run once per ATen operator of every forward run and recomputation that a
    policy, a write watch or a trace follows, always inside a remat'd call's eager code: the
    wrapper cost more than some modes' own work. The same protection is kept where it applies
    (a ``torch.compile``'d function called inside the remat'd function, its frame callback set).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (torch's wrapper: replaced by the conditional one below)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]
        raw = cls.__dict__.get("__torch_dispatch__")
        if raw is not None and not isinstance(raw, classmethod):
            cls.__torch_dispatch__ = _dispatch_unless_compiled(raw)  # type: ignore[method-assign]


def _dispatch_unless_compiled(raw: _F) -> _F:
    """``raw``, a ``__torch_dispatch__``, through ``torch.compiler.disable`` where Dynamo's frame
    callback is set (eager code a compiled function runs, whose callees it would compile). (Unlike
    :func:`compiler_disable`, no ``is_compiling()``: the dispatcher calls a mode from C++, never
    from code Dynamo traces.)"""
    disabled = cast("Callable[..., Any]", torch.compiler.disable(raw))  # type: ignore[no-untyped-call]
    run = cast("Callable[..., Any]", raw)

    @functools.wraps(raw)
    def dispatch(self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if eval_frame_callback() is not None:
            return disabled(self, func, types, args, kwargs)
        return run(self, func, types, args, kwargs)

    skip_code(dispatch.__code__)  # type: ignore[attr-defined]  # (its own frame, which decides, is not Dynamo's to compile either)
    return cast(_F, dispatch)


# ------------------------------------------------------------ operators
#: ATen operator overloads and their packets, for policies.
OpOverload: Any = torch._ops.OpOverload
OpOverloadPacket: Any = torch._ops.OpOverloadPacket


#: ``torch.library``, typed: define the operator ``ns::schema`` with one kernel for ``dispatch_key``.
#: Returns the library, which must be kept alive for the operator to stay registered.
def define_operator(
    ns: str, schema: str, name: str, kernel: Callable[..., Any], dispatch_key: str
) -> torch.library.Library:
    lib = torch.library.Library(ns, "DEF")  # type: ignore[no-untyped-call]  # noqa: TOR901 - the namespace is ours
    lib.define(schema)  # type: ignore[no-untyped-call]
    lib.impl(name, kernel, dispatch_key)  # type: ignore[no-untyped-call]
    return lib


# ------------------------------------------------------------ tensors
def has_gradient_dtype(t: torch.Tensor) -> bool:
    """Can ``t`` carry a gradient at all (a floating-point or complex dtype)?

    The one dtype test of the package. Whether a gradient will actually flow into
    an input (it requires grad at its level, or carries a tangent) is another
    question, answered by ``_capture.differentiable_input``.
    """
    return t.is_floating_point() or t.is_complex()


def made_under_no_grad(t: torch.Tensor) -> bool:
    """Is ``t`` a view made under ``no_grad`` of a tensor that requires grad (``with torch.no_grad():
    b = h[1]``)? It says it requires grad but has no ``grad_fn``: no gradient goes through it to
    its base, and autograd refuses it as an output to differentiate."""
    return t.requires_grad and t.grad_fn is None and t._base is not None


def bottom(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any functorch wrappers (what dispatch modes see)."""
    while is_functorch_wrapped(x):
        x = unwrap_one_level(x)
    return x


#: ``UntypedStorage.clone()``, typed: a copy of ``storage`` on its device.
def clone_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    return cast(torch.UntypedStorage, storage.clone())  # type: ignore[no-untyped-call]


def storage_of(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage, or ``None`` for tensors without one (batched, functorch).

    The address of the storage object itself (``_cdata``), not of its data:
    empty and meta tensors all have a null data pointer but distinct storages.
    """
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


#: The name of the list of nodes in the closure of the hooks ``register_multi_grad_hook(mode="all")``
#: registers (torch >= 2.1): one node per tensor it was registered on, each tensor's ``grad_fn`` or
#: gradient accumulator, which the engine is asked about to count the gradients the hook waits for.
_MULTI_GRAD_HOOK_NODES = "grad_fns"


def multi_grad_hook_nodes(hook: Any) -> list[Any] | None:
    """The list of autograd nodes a hook that ``torch.autograd.graph.register_multi_grad_hook``
    registered (``mode="all"``) counts, shared by the hooks of that one registration; ``None`` for
    any other hook (one of ``mode="any"`` counts no nodes).

    The hook (``inner_hook``) keeps them in a closure cell: replacing an entry makes the hook wait
    for another node's gradient (see ``funckpt._call._move_input_hooks``)."""
    code = getattr(hook, "__code__", None)
    if code is None or "register_multi_grad_hook" not in getattr(hook, "__qualname__", ""):
        return None
    try:
        nodes = hook.__closure__[code.co_freevars.index(_MULTI_GRAD_HOOK_NODES)].cell_contents
    except (ValueError, TypeError, IndexError):
        return None
    return nodes if isinstance(nodes, list) else None


def grad_node_of(t: torch.Tensor) -> Any:
    """``t``'s ``grad_fn``, or its gradient accumulator where it is a leaf that requires grad (what
    ``register_multi_grad_hook`` asks the engine about), as torch's own helper gives it."""
    return torch.autograd.graph._get_grad_fn_or_grad_acc(t)
