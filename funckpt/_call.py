"""One checkpointed call: the eager path, and the region of the user's function.

``call`` turns ``fn(*args, **kwargs)`` into a *region* for the autograd
machinery in ``_autograd.py``: it flattens the arguments with optree
(``_pytree.py``), adds the tensors ``fn`` reaches through closures, partials
and modules (``_capture.py``) as inputs, applies the region, and rebuilds the
outputs (views of inputs and of each other included, ``_aliasing.py``).

:class:`UserRegion` owns what one call must replay: the random-number
generators (``_rng.py``), autocast (``_autocast.py``), snapshots of the inputs
``fn`` writes in place, and what the determinism check compares against
(``_errors.py``). Its forward run and its recomputation are two methods, each
reading top to bottom; they share the context they run ``fn`` in
(:meth:`UserRegion._running`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import inspect
import operator
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

import optree
import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import _aliasing, _autocast, _rng, _tail
from ._autograd import Phase, Region, apply, eager_under_compile, forget_nested_regions, local_input
from ._capture import (
    attributes_as_at_the_call,
    _METADATA,
    PUT_BACK,
    SPENT,
    Captured,
    Roots,
    global_module_hooks,
    stored_attributes,
    Substitute,
    FollowingItsHandle,
    Handles,
    no_hook,
    Taint,
    Reached,
    changed_captures,
    differentiable_input,
    freed_value,
    in_a_recomputation,
    enter_unwatched,
    find_captured,
    global_names,
    has_tangent,
    is_generator,
    is_sharded,
    leave_unwatched,
    local_graph_leaves,
    nested_run,
    next_sequence_nr,
    refuse_other_threads_stand_ins,
    refused_around,
    reparametrized,
    route_through_enclosing,
    set_internal,
    substitution_depth,
    tensors_inside,
    training_as_at_the_call,
    backward_hooks_now,
    CallersNodes,
)
from ._compile import can_lower, lowered_call, skip_as_frame
from ._draws import Redraw, differs_here, enter_run, functorch_at_the_call, leave_run
from ._errors import (
    AUTOCAST_UNDER_TRANSFORMS_HINT,
    KEPT_HINT,
    CheckpointError,
    Digest,
    OpTrace,
    TracedDraws,
    check_same_outputs,
    check_same_values,
    debug_enabled,
    digest,
    rebound_error,
    reproduced,
    tensor_meta,
    the_recomputation,
)
from ._internals import (
    PLAIN_TENSORS,
    is_fake,
    graph_traced,
    AccumulateGrad,
    CreationMeta,
    DisableFuncTorch,
    GlobalHooks,
    global_module_hooks_as_at_the_call,
    default_dtype_as_at_the_call,
    global_module_hooks_now,
    global_module_hooks_registered,
    grad_node_of,
    multi_grad_hook_nodes,
    add_batch_dim,
    class_forward,
    is_batchedtensor,
    maybe_get_level,
    unwrap_batched,
    unwrap_one_level,
    unwrap_if_dead,
    at_a_grad_level_of_its_own,
    autograd_excluded,
    call_with_own_hooks,
    exporting,
    is_dead_tensor_wrapper,
    has_own_hooks,
    has_gradient_dtype,
    hide_saved_tensors_hooks,
    FunctionModesBack,
    bottom,
    callers_function_modes,
    module_trackers_off,
    forward_ad_level,
    made_under_no_grad,
    forward_mode_active,
    fwd_grad_enabled,
    get_creation_meta,
    is_functorch_wrapped,
    level_kinds,
    grad_levels_active,
    jvp_levels_active,
    outside_functorch,
    parametrization_cache,
    peek_interpreter_stack,
    register_tensor_hook,
    restore_saved_tensors_hooks,
    set_fwd_grad_mode,
    set_grad_enabled,
    script_optimized,
    set_script_optimized,
    storage_of,
    TransformType,
    transforms_active,
    user_saved_tensors_hooks,
    vmap_active,
)
from ._options import RematOptions, callable_name, check_static_argnums
from ._pytree import MUTABLE, NAMESPACE, ArgSpec, TreeSlots, argument_containers, flatten, flatten_args, holds_containers, map_back, tree_flatten
from ._residuals import notify
from ._saving import (
    Replayer,
    Saved,
    WriteWatch,
    clone_together,
    detach_kept_since,
    held_by_recording_regions,
    recording_marks,
)
from .policies import nothing_saveable

__all__ = ["UserRegion", "call", "finish", "nothing_to_differentiate", "prepare", "run_prepared"]

_T = TypeVar("_T")


def call(
    fn: Callable[..., Any],
    options: RematOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    wrapped: bool = False,
) -> Any:
    """One checkpointed call of ``fn(*args, **kwargs)``.

    Under ``torch.compile`` the call becomes the compiler's checkpoint region
    where it can, and otherwise a graph break around the eager call below
    (``_compile.py`` says which and why). ``wrapped``: ``fn`` is the module a
    ``remat`` wrapper wraps, called with its own hooks only (see :class:`WrappedModuleRegion`).
    """
    # (torch.compiler.is_compiling() asked once: it is two Python calls, on every remat'd call.)
    compiling = torch.compiler.is_compiling()
    if recorded_as_the_function(compiling):
        if not wrapped:
            return fn(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():  # (strict export; as the lowered call below takes it)
            # Dynamo cannot trace call_with_own_hooks' copy of Module._call_impl (its globals).
            return fn(*args, **kwargs) if has_own_hooks(fn) else cast(Any, fn).forward(*args, **kwargs)
        return call_with_own_hooks(fn, args, kwargs)
    if compiling:
        if can_lower(options):
            if wrapped and not has_own_hooks(fn):  # (its forward: the wrapper ran the global hooks)
                return lowered_call(cast(Any, fn).forward, options, args, kwargs)
            return lowered_call(fn, options, args, kwargs)
    return _call_eagerly(fn, options, args, kwargs, wrapped)


skip_as_frame(call)


def recorded_as_the_function(compiling: bool | None = None) -> bool:
    """Is a tracer recording the program's operators for a graph that runs without remat:
    ``torch.export.export`` (strict or not), ``torch.jit.trace`` (and the TorchScript-based ONNX
    export)? There a remat'd call is its function: the graph computes the same values.

    torch's own checkpoint cannot be recorded by some of them: its compiler region fails
    strict export (on a key of the region's metadata export drops), its reentrant Function
    ``jit.trace``; eager remat, a Python ``autograd.Function`` reading values, cannot read
    non-strict export's fake tensors or be traced by ``jit.trace``. The graphs torch records of
    non-reentrant ``torch.utils.checkpoint`` (non-strict export, ``jit.trace``) hold no
    checkpoint either. ``compiling``: ``torch.compiler.is_compiling()``, where the caller asked it.
    """
    if torch._C._get_tracing_state() is not None:  # (jit.trace; its None test is one C call)
        return True
    return (torch.compiler.is_compiling() if compiling is None else compiling) and exporting()


@eager_under_compile
def _call_eagerly(
    fn: Callable[..., Any], options: RematOptions, args: tuple[Any, ...], kwargs: dict[str, Any], wrapped: bool = False
) -> Any:
    if nothing_to_differentiate():
        # Under no_grad or inference_mode with no transform: nothing will be
        # recomputed, so remat is fn itself (a function that enables grad inside
        # then records its graph, as it would without remat).
        check_static_argnums(callable_name(fn), options, args)
        return call_with_own_hooks(fn, args, kwargs) if wrapped else fn(*args, **kwargs)
    if issubclass(type(fn), _DDP):  # (by its type: a remat wrapper poses as the class it wraps)
        return _ddp_around(cast(torch.nn.parallel.DistributedDataParallel, fn), options, args, kwargs, wrapped)
    _initialize_if_lazy(fn, args, kwargs)
    sharded = not wrapped and isinstance(fn, torch.nn.Module) and is_sharded(fn)
    if (wrapped or sharded) and has_own_hooks(fn) and cast(Any, fn)._compiled_call_impl is None:
        # A module managed by FSDP2 (``checkpoint(sharded_block, h)``, ``remat(fully_shard(block))``)
        # too: its hooks, which gather its parameters and shard them again, run around the
        # checkpointed forward, which then sees them gathered (see _capture._fsdp_hooks_would_run),
        # as does its recomputation, after the hook FSDP puts on the outputs gathered them again.
        return _with_own_hooks_around(cast(torch.nn.Module, fn), options, args, kwargs)
    name = None
    if type(fn) is functools.partial:
        name = callable_name(fn)
        fn, args, kwargs = _partial_arguments(fn, args, kwargs, positional=not options.static_argnums)
    return run_prepared(*prepare(fn, options, args, kwargs, make_region=WrappedModuleRegion if wrapped else None, name=name))


_DDP = torch.nn.parallel.DistributedDataParallel


def _ddp_around(
    ddp: torch.nn.parallel.DistributedDataParallel,
    options: RematOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    wrapped: bool,
) -> Any:
    """The checkpointed call of a ``DistributedDataParallel`` module is DDP's forward around the
    checkpointed call of the module it wraps: ``remat(DDP(m))`` and ``checkpoint(ddp, x)`` compute
    what ``DDP(remat(m))`` does.

    DDP prepares its gradient reduction in its forward, from the caller's autograd graph: with
    ``find_unused_parameters`` it walks the graph of the outputs for the parameters used, and
    with ``static_graph`` a node on the outputs schedules the first step's all-reduce for the end
    of the backward pass. Inside the checkpointed call the forward run records no graph to the
    parameters, and the recomputation runs DDP's forward again in the middle of the backward
    pass: the reducer took every parameter for unused (then raised "marked ready twice"), or
    reduced before the gradients existed (silently wrong ones). So DDP's forward runs here, on
    the caller's tensors and grad mode, with the module it wraps standing as a remat wrapper of
    it for the call (its ``module`` attribute is put back after; the same module object must not
    run in two threads at once, as for any remat'd module).
    """
    from ._modules import Remat  # (that module builds on this one)

    inner = ddp._modules["module"]
    assert inner is not None
    ddp._modules["module"] = Remat(inner, options)
    try:
        return call_with_own_hooks(ddp, args, kwargs) if wrapped else ddp(*args, **kwargs)
    finally:
        ddp._modules["module"] = inner


def _partial_arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], positional: bool
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``functools.partial(f, *a, **k)(*args, **kwargs)`` as the call of ``f`` it is: the partial's
    arguments become the region's arguments (the positional ones only where ``positional``: the
    positions of ``static_argnums`` are the caller's).

    Reached through the partial instead, its tensors would be captured tensors, which the
    substitution mode swaps where an operator receives them: a custom ``autograd.Function``
    receives them unseen (HF's checkpointing calls ``partial(layer.forward, **kwargs)``, and
    SEW-D's attention applies its dropout Function to a keyword argument), and the gradient
    would be missing. As arguments, the function receives the region's own inputs.
    """
    while type(fn) is functools.partial and (positional or not fn.args):
        args, kwargs = (*fn.args, *args), {**fn.keywords, **kwargs}
        fn = fn.func
    if type(fn) is functools.partial and fn.keywords:
        # (its positional arguments stay the partial's: only the keywords move)
        kwargs, fn = {**fn.keywords, **kwargs}, functools.partial(fn.func, *fn.args)
    return fn, args, kwargs


def _with_own_hooks_around(module: torch.nn.Module, options: RematOptions, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call of a module a ``remat`` wrapper wraps, that has hooks of its own: they run around
    the checkpointed ``forward``, once, on the caller's tensors, as without remat.

    Inside the region a hook would see the run's own stand-ins for the inputs: a forward hook
    keeping the layer's input (transformers' recorder of ``output_hidden_states``, which HF puts
    on the layers at a model's first call, or at a backbone's construction) would keep a tensor
    no gradient reaches the caller through, and the recomputation would run it again. torch's
    own ``_call_impl`` runs them (the module's alone, see :func:`call_with_own_hooks`), with the
    module's ``forward`` standing for the region while it does.

    Also the call of a module FSDP2 manages, remat'd or checkpointed itself: its hooks gather its
    parameters before the region walks the module (and shard them again after), and the hook FSDP
    puts on the outputs gathers them again before the recomputation.
    """
    forward = module.forward  # (bound, or what a library set on the instance)

    def region(*a: Any, **k: Any) -> Any:
        made, routed = prepare(module, options, a, k, make_region=_ForwardRegion)
        cast(_ForwardRegion, made).forward = forward
        return run_prepared(made, routed)

    return call_with_own_hooks(module, args, kwargs, forward=region)


def run_prepared(region: UserRegion, routed: list[torch.Tensor]) -> Any:
    """Apply a :func:`prepare`'d region and :func:`finish` its result (then carry back what the
    function wrote into its copies of the caller's containers, and settle its escapes)."""
    try:
        outs = apply(region, routed)
        result = finish(region, routed, outs)
        if region.escaped_views:
            region.point_kept_views()
        writes, returned = region.container_writes, region.returned_container
        held = region.held_escapes
        if held:  # (the class's empty list otherwise: nothing to reset on the common path)
            region.held_escapes = []
        if (writes or held) and region.written_made:  # (the Function's outputs, of the caller's level)
            # (k < 0: the caller's output -k - 1, rebuilt by the plan, is the one fn also returned)
            rebuilt = flatten(result)[0] if min(region.written_made.values()) < 0 else []
            back = {key: outs[k] if k >= 0 else rebuilt[-k - 1] for key, k in region.written_made.items()}
            if writes:
                writes = [(mine, [map_back(v, back) for v in content]) for mine, content in writes]
            for slot in held:
                _put_back(slot, back[id(slot.alias)])
            del held
    finally:
        region.caller_arguments = region.container_writes = region.returned_container = None
        region.written_made = region.at_the_call = None
    restore = _carry_back(writes) if writes else None
    if returned is not None:  # (a copy of one of the caller's containers: the caller's own, written back)
        result = returned
    escaped = region.escaped_outputs()
    if escaped:  # which of them the caller's code holds, once nothing here does
        refs = [weakref.ref(t) for t in outs[len(outs) - escaped :]]
        del outs
        try:
            region.settle_escapes(refs)
        except BaseException:
            if restore is not None:  # (the call failed: its writes are not the caller's)
                restore()
            raise
    return result


def _put_back(slot: HeldEscape, output: torch.Tensor) -> None:
    """Put ``output`` where the forward run left the tensor it stands for (see HeldEscape): at its
    place, or where the alias moved to since (a list the run went on inserting into)."""
    if is_functorch_wrapped(output):  # (a recomputation reading it is told as a kept tensor: Substitute._check)
        setattr(output, PUT_BACK, True)
    holder = slot.holder
    if _place_holds(holder, slot.key, slot.alias):
        _set_place(holder, slot.key, output)
        return
    for key in _keys_of(holder):
        if _get_place(holder, key) is slot.alias:
            _set_place(holder, key, output)
            return


class _InTuple(NamedTuple):
    """The place of an item of a tuple (or a namedtuple) that ``holder`` holds at ``key``: a tuple
    cannot be written, so a write there puts a new tuple in its place, its items the same but that
    one (see UserRegion._swap_held_for_aliases). ``holder`` is a list, a dict, a closure cell or
    another such place (a tuple in a tuple)."""

    holder: Any
    key: Any


#: The key of a closure cell's one place (``nonlocal h; h = ...``, a function's own cell).
_CELL = object()


def _setitem_of(holder: Any) -> Callable[[Any, Any, Any], None]:
    """The ``__setitem__`` of ``holder``'s list or dict class, the builtin one or ``collections``'
    it derives from (a subclass's own, which may do more, is passed over: what is written is a tensor
    of the same value in the same place, standing for the one written there)."""
    base = next(b for b in type(holder).__mro__ if b.__module__ in ("builtins", "collections"))
    return cast(Callable[[Any, Any, Any], None], getattr(base, "__setitem__"))


def _get_place(holder: Any, key: Any) -> Any:
    if isinstance(holder, _InTuple):
        return _get_place(holder.holder, holder.key)[key]
    if key is _CELL:
        return holder.cell_contents
    return (dict.__getitem__ if isinstance(holder, dict) else list.__getitem__)(holder, key)


def _set_place(holder: Any, key: Any, value: Any) -> None:
    if isinstance(holder, _InTuple):
        old = _get_place(holder.holder, holder.key)
        items = list(old)
        items[key] = value
        _set_place(holder.holder, holder.key, type(old)._make(items) if hasattr(type(old), "_make") else tuple(items))
    elif key is _CELL:
        holder.cell_contents = value
    else:
        _setitem_of(holder)(holder, key, value)


def _keys_of(holder: Any) -> Iterable[Any]:
    """The keys of ``holder``'s places (an empty tuple's where a tuple's holder no longer holds one)."""
    if isinstance(holder, _InTuple):
        try:
            items = _get_place(holder.holder, holder.key)
        except (KeyError, IndexError, ValueError):
            return ()
        return range(len(items)) if isinstance(items, tuple) else ()
    if isinstance(holder, types.CellType):
        return (_CELL,)
    return list(dict.keys(holder)) if isinstance(holder, dict) else range(len(holder))


def _place_holds(holder: Any, key: Any, value: Any) -> bool:
    """Does ``holder`` hold ``value`` at ``key`` (still there, not moved since)?"""
    try:
        return _get_place(holder, key) is value
    except (KeyError, IndexError, ValueError, TypeError):
        return False


def _recorded_by_transformers(t: torch.Tensor) -> str | None:
    """The key (``attentions``, ``router_logits``, ...) under which transformers' output recorder,
    active now, holds ``t``, if it does (read from its ContextVar only where transformers is loaded)."""
    module = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(module, "_active_collector", None)
    try:
        collected = collector.get() if collector is not None else None
    except Exception:  # (another version's recorder: nothing to tell)
        return None
    if not isinstance(collected, dict):
        return None
    for key, values in collected.items():
        if isinstance(values, list) and any(v is t for v in values):
            return str(key)
    return None


def _reached_directly(fn: Any) -> set[int]:
    """The ids of what a function's closure cells, partial arguments and the globals its code
    names hold (not further: told only where the function wrote a container it was passed)."""
    found: set[int] = set()
    if isinstance(fn, functools.partial):
        found.update(map(id, fn.args))
        found.update(map(id, fn.keywords.values()))
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    if isinstance(fn, types.FunctionType):
        for cell in fn.__closure__ or ():
            try:
                found.add(id(cell.cell_contents))
            except ValueError:  # (an empty cell)
                pass
        scope = fn.__globals__  # (the names its code loads as globals: not co_names, which holds attribute names too)
        found.update(id(scope[name]) for name in global_names(fn.__code__) if name in scope)
    return found


#: The global containers :meth:`UserRegion._refuse_stored_inputs` looks into.
_STORES = frozenset({list, dict, set, collections.deque})


def _places_holding(found: list[torch.Tensor], ids: set[int]) -> list[tuple[Any, Any]]:
    """The places (holder, key) that hold a tensor of ``found`` (whose ids are ``ids``) directly, as
    found by the garbage collector's referrers: a list's index, a dict's key, a closure cell's content,
    or an item of a tuple that one of those holds (through tuples, a few deep). (A deque, a set, an
    object's slots, a frame's local are not places: what they hold stays alive, and is refused.)"""
    places: list[tuple[Any, Any]] = []
    referrers = gc.get_referrers(*found)
    for holder in referrers:
        if holder is found:
            continue
        if isinstance(holder, tuple) and _rebuildable(holder):
            indices = [i for i, v in enumerate(holder) if id(v) in ids]
            outers = _places_of_tuple(holder, 0, [referrers])
            places.extend((_InTuple(*outer), i) for outer in outers for i in indices)
        elif _is_place(holder):
            places.extend((holder, key) for key in _keys_of(holder) if id(_get_place(holder, key)) in ids)
    return places


def _rebuildable(t: tuple[Any, ...]) -> bool:
    """Can a tuple like ``t`` be made with other items (a tuple, a namedtuple), and is it the user's
    (funckpt's own records, namedtuples, are not places)?"""
    kind = type(t)
    return kind is tuple or (hasattr(kind, "_make") and not kind.__module__.startswith("funckpt"))


def _is_place(holder: Any) -> bool:
    """Is ``holder`` a list, a dict, or a closure cell of a function not funckpt's own?"""
    if isinstance(holder, types.CellType):
        return _users_cell(holder)
    return isinstance(holder, (list, dict))


def _users_cell(cell: types.CellType) -> bool:
    """Is ``cell`` in the closure of a function that is not funckpt's (the user's ``nonlocal`` state,
    not a cell of funckpt's own frames that held the tensor a moment)?"""
    for closure in gc.get_referrers(cell):
        if isinstance(closure, tuple):
            for fn in gc.get_referrers(closure):
                if isinstance(fn, types.FunctionType) and fn.__closure__ is closure:
                    if not (fn.__module__ or "").startswith("funckpt"):
                        return True
    return False


#: How deep in tuples :func:`_places_holding` looks for a tensor (a pair in a tuple of layers' pairs).
_TUPLE_DEPTH = 4


def _places_of_tuple(tup: tuple[Any, ...], depth: int, walking: list[list[Any]]) -> list[tuple[Any, Any]]:
    """The places that hold the tuple ``tup``: a list's, a dict's, a cell's, or a tuple's that one
    holds. (``walking``: the lists of referrers the walk is going through, which hold it too.)"""
    found: list[tuple[Any, Any]] = []
    referrers = gc.get_referrers(tup)
    for holder in referrers:
        if any(holder is w for w in walking):
            continue
        if isinstance(holder, tuple) and holder is not tup:
            if depth < _TUPLE_DEPTH and _rebuildable(holder):
                indices = [i for i, v in enumerate(holder) if v is tup]
                outers = _places_of_tuple(holder, depth + 1, [*walking, referrers])
                found.extend((_InTuple(*outer), i) for outer in outers for i in indices)
        elif _is_place(holder):
            found.extend((holder, key) for key in _keys_of(holder) if _get_place(holder, key) is tup)
    return found


class HeldEscape(NamedTuple):
    """A place (a list's index, a dict's key) that held a tensor the forward run computed, under a
    torch.func transform, and holds a detached alias of it until the call puts there the output of
    the caller's level that stands for it (see UserRegion._swap_held_for_aliases)."""

    holder: Any
    key: Any
    alias: torch.Tensor
    position: int  # among the tensors the run's operators returned
    returned: int | None  # among the outputs, where the function returned it too
    tensor: weakref.ref[torch.Tensor]  # (to put back where the call raises)


class _Item(NamedTuple):
    key: Any
    value: Any


def _shallow(container: Any) -> tuple[Any, ...]:
    """A list's, deque's or dict's entries (a dict's as its items), to tell a write by."""
    return tuple(map(_Item._make, container.items())) if isinstance(container, dict) else tuple(container)


def _written(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """Was an entry added, removed or replaced between two :func:`_shallow` views of a container?
    (By identity: a dict's copy has the caller's very keys.)"""
    if len(before) != len(after):
        return True
    if before and type(before[0]) is _Item:
        return any(a.key is not b.key or a.value is not b.value for a, b in zip(before, after))
    return any(a is not b for a, b in zip(before, after))


def _fill(container: Any, content: Sequence[Any]) -> None:
    """Make ``container``'s entries ``content`` (a dict's: its items)."""
    if isinstance(container, dict):
        if type(container) in (dict, collections.OrderedDict, collections.defaultdict):
            container.clear()
            container.update(content)
            return
        # (A dict of a class of its own, transformers' ModelOutput: the writes, as the function made them.)
        keys = {k for k, _ in content}
        for k in [k for k in container if k not in keys]:
            del container[k]
        for k, v in content:
            if k not in container or container[k] is not v:
                container[k] = v
    elif isinstance(container, collections.deque):
        container.clear()
        container.extend(content)
    else:
        container[:] = content


def _carry_back(writes: list[tuple[Any, list[Any]]]) -> Callable[[], None]:
    """Write into the caller's containers what the function wrote into its copies; return what
    puts them back as they were."""
    before = [(container, list(_shallow(container))) for container, _ in writes]
    for container, content in writes:
        _fill(container, content)

    def restore() -> None:
        for container, content in before:
            _fill(container, content)

    return restore


def _initialize_if_lazy(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A lazy module's first call (``remat(nn.LazyLinear(4))``): its parameters, shaped from
    the arguments, before remat routes them.

    Its forward pre-hook would infer them inside the call, too late: remat takes the
    module's parameters as inputs before calling it. So the hook's own work runs here,
    on the same arguments and before anything else of the call, as it would without remat
    (``reset_parameters`` draws from the generator before the forward's dropout does).
    Only where that hook is the module's first pre-hook (another before it could change
    the arguments); lazy modules elsewhere raise in :func:`_refuse_uninitialized`.
    """
    if not isinstance(fn, LazyModuleMixin) or not fn.has_uninitialized_params():
        return
    hook = getattr(fn, "_initialize_hook", None)
    if hook is not None and next(iter(fn._forward_pre_hooks), None) == hook.id:
        # Outside any torch.func transform: the initialization reads the arguments' shapes
        # only, and under one torch's in-place initializers crash (a LazyLinear's first call
        # inside torch.func.grad without remat: a segmentation fault in kaiming_uniform_).
        with outside_functorch():
            fn._infer_parameters(fn, args, kwargs)


def _refuse_uninitialized(name: str, captured: Captured, tensors: Sequence[torch.Tensor]) -> None:
    """Raise if the call reaches a lazy module's parameters before they are initialized."""
    lazy = [t for t in tensors if is_lazy(t)]
    if not lazy:
        return
    holders = [(n.count("."), f"{type(m).__name__}'s {n!r}") for m, named in captured.modules for n, t in named.items() if t is lazy[0]]
    owner = min(holders)[1] if holders else "a tensor"  # the lazy module itself, not a model around it
    raise CheckpointError(
        f"remat({name}): the function reaches {owner}, an uninitialized parameter of a lazy module. "
        "remat takes the parameters it reaches as inputs before calling the function, so a lazy "
        "module inside it cannot infer them on its first call. Initialize it first: call the model "
        "once on a batch (under torch.no_grad()) before the remat'd call, or remat the lazy module "
        "itself (remat(nn.LazyLinear(n)) initializes it on its first call)."
    )


def prepare(
    fn: Callable[..., Any],
    options: RematOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    make_region: Callable[..., UserRegion] | None = None,
    name: str | None = None,
    reaches: Any = None,
) -> tuple[UserRegion, list[torch.Tensor]]:
    """The region of ``fn(*args, **kwargs)`` and its flat inputs, ready for :func:`~funckpt._autograd.apply`.

    ``make_region`` builds a :class:`UserRegion` subclass (a checkpointed loop's);
    ``reaches`` is what to walk for captured tensors instead of ``fn`` (the user's
    step function, not the loop driver that calls it).
    """
    name = callable_name(fn) if name is None else name
    static = check_static_argnums(name, options, args)
    try:
        arg_tensors, argspec = flatten_args(args, kwargs, static)
    except RecursionError:
        raise _too_deep(name, args, kwargs, static) from None

    flat: list[torch.Tensor] = []
    slot_of: dict[int, int] = {}

    def slot(t: torch.Tensor) -> int:
        if id(t) not in slot_of:
            slot_of[id(t)] = len(flat)
            flat.append(t)
        return slot_of[id(t)]

    arg_index = [slot(t) for t in arg_tensors]
    # Non-tensor arguments (modules, objects optree does not flatten, static arguments)
    # are walked like captured values, so the tensors they hold are routed:
    # remat(lambda x, m: m(x))(x, net) works.
    objects = [
        leaf
        for leaf in (*argspec.dynamic.leaves, *argspec.static.values())
        if leaf is not None and not isinstance(leaf, (str, bytes, int, float, complex))
    ]
    roots = [*(reaches if isinstance(reaches, Roots) else [fn if reaches is None else reaches]), *objects]
    roots += global_module_hooks()  # (run by every module the function calls: see _capture)
    captured = find_captured(Roots(roots) if len(roots) > 1 else roots[0], record_places=True)
    refused = refused_around(captured)  # (a call nested in another's run: see refused_around)
    if refused:
        captured = dataclasses.replace(captured, tensors=[t for t in captured.tensors if id(t) not in refused])
    refuse_other_threads_stand_ins(name, captured.tensors)
    captured_index = [slot(t) for t in captured.tensors]
    _refuse_uninitialized(name, captured, flat)
    routed = route_through_enclosing(flat)
    if any(t.grad_fn is not None for t in captured.tensors):  # (a closure over a computed tensor: rare)
        routed = _stand_in_for_freed(name, routed, flat, captured_index, arg_index)
    region = (make_region or UserRegion)(
        fn,
        name,
        options,
        argspec,
        arg_index,
        captured,
        captured_index,
        differentiable=[differentiable_input(t) for t in routed],
        outer=flat,
        objects=objects,
    )
    if refused:
        region.refused = refused
    if transforms_active():
        top = peek_interpreter_stack()  # (None where a level is alive but lowered off the stack)
        required = [t.requires_grad for t in routed]
        # (Also where none requires grad at the call's grad or jvp level, as long as grad mode is on:
        # they may below it, in plain autograd, where the forward run goes lowered (a tensor the
        # caller computed there from a module's parameter, every input of a remat'd call nested in
        # another's run at a grad level of its own, which wraps them: see _reads_a_lower_levels_grad).)
        if torch.is_grad_enabled() and (
            any(required) or (top is not None and top.key() in (TransformType.Grad, TransformType.Jvp))
        ):
            region.required_grad_at_call = required
            region.at_the_call = routed
            # Only a tensor of the innermost level requires grad there: what the function computes
            # from one of a level below (a module's parameter, a tensor an outer grad wraps) is a
            # tensor of the innermost level that says it requires none, as without remat.
            innermost = -1 if top is None else top.level()
            region.of_the_innermost_level = [maybe_get_level(t) == innermost for t in routed]
        kinds = level_kinds()
        region.rewrapped_for_caller = TransformType.Grad in kinds or TransformType.Jvp in kinds
        region.under_transforms = True
        region.vmap_innermost_at_call = top is not None and top.key() == TransformType.Vmap
        region.grad_level_at_call = TransformType.Grad in kinds
        if top is not None and top.key() in (TransformType.Grad, TransformType.Jvp):
            region.grad_level_of_the_call = top.level()
    region.function_modes = callers_function_modes()
    region.callers_tensors = routed  # (whose grad_fn the function reads as its inputs': see CallersNodes)
    if not argspec.tensors_only and holds_containers(argspec.dynamic.treespec):  # (see UserRegion._container_writes)
        region.caller_arguments = (tuple(a for i, a in enumerate(args) if i not in static), kwargs, tuple(flat))
    notify(region, tuple(routed))
    return region, routed


def _stand_in_for_freed(
    name: str, routed: list[torch.Tensor], flat: list[torch.Tensor], captured_index: list[int], arg_index: list[int]
) -> list[torch.Tensor]:
    """Route each captured value whose graph a backward pass has freed (:func:`freed_value`) as a
    detached stand-in: a leaf that refuses, in the backward pass, a gradient reaching it.

    Routed itself, the value's graph would be visited by the autograd engine in every backward pass
    through the call, even where no gradient reaches it (the function overwrites the attribute that
    holds it, as an MoE layer's ``self.aux_loss`` after a step without checkpointing, or reads it
    only as a constant), and the engine would raise "Trying to backward through the graph a second
    time" on a program that runs without remat. Left out of the call, the function could not use
    it (forward-only, under ``jvp`` or ``vmap``, or differentiated elsewhere). A gradient that does
    reach it would go through the freed graph without remat, and fail there: the stand-in's hook
    says so. (An argument is the caller's to pass; a forward-mode dual keeps its tangent itself.)
    """
    args = set(arg_index)
    routed = list(routed)  # (route_through_enclosing may return ``flat`` itself)
    for i in captured_index:
        t = flat[i]
        if t.grad_fn is None or i in args or routed[i] is not t or not freed_value(t) or has_tangent(t):
            continue
        with DisableFuncTorch():  # (a leaf of plain autograd, as ``t`` is, also under a transform)
            stand_in = t.detach()
            stand_in.requires_grad = True  # (requires_grad_() is refused under a transform)
        shape = tuple(t.shape)

        def refuse(grad: torch.Tensor | None, shape: tuple[int, ...] = shape) -> None:
            if grad is None:  # (the engine visits the leaf, and no gradient reached it)
                return
            raise CheckpointError(
                f"remat({name}): the backward pass reached a tensor of shape {shape} that the function "
                "used and that an earlier call computed and kept (a module attribute, a list, a global), "
                "whose graph a backward pass has freed since: without remat this backward pass would "
                "raise 'Trying to backward through the graph a second time'. Detach it where it is kept "
                "if it is state, or compute it again before reading it."
            )

        stand_in.register_hook(refuse)  # type: ignore[no-untyped-call]
        routed[i] = stand_in
    return routed


def finish(region: UserRegion, routed: list[torch.Tensor], outs: tuple[torch.Tensor, ...]) -> Any:
    """The caller's result: the region's outputs in ``fn``'s output structure, views rebuilt."""
    assert region.out_slots is not None
    if region.tainted_escapes:
        region.refuse_tainted_survivors()
    escaped = region.escaped_outputs()
    kept: tuple[torch.Tensor, ...] = ()
    if escaped and region.plan is None:  # (the caller reaches those where fn left them)
        outs, kept = outs[: len(outs) - escaped], outs[len(outs) - escaped :]
    # (With a plan, rebuild returns the outputs fn returned; views of escaped ones among them.)
    tensors = _aliasing.rebuild(region.plan, outs, routed)
    if region.retained_outputs or region.retains_kept:
        _retain_grads(region, tensors, kept)
    return region.out_slots.fill(tensors)


def _retain_grads(region: UserRegion, tensors: list[torch.Tensor], escaped: Sequence[torch.Tensor]) -> None:
    """``retain_grad()`` that fn called on tensors it returns or keeps, on the caller's tensors.

    Autograd fills those with the gradient reaching the caller's output; where fn computed
    another output from that one (``h.retain_grad(); return h, h.exp()``), the part through the
    other output reaches ``h`` only in the recomputation, whose ``h`` retains its grad too: the
    backward pass adds that part (:func:`funckpt._autograd.vjp`), so ``.grad`` is the whole
    gradient, as without remat. A tensor the run kept outside the call (``kept.append(h)``, also
    returned) is the caller's as it is, its own ``retain_grad`` left on the run's graph: it gets the
    recomputation's whole gradient. (An output rebuilt as a view outside the call gets the first part.)
    """
    retained: list[tuple[int, Any, bool]] = []  # (position among the Function's outputs, the caller's tensor, hooked here)
    for k in region.retained_outputs:
        t = tensors[k]
        hooked = t.requires_grad and not t.retains_grad
        if hooked:
            t.retain_grad()
        if region.plan is None:
            retained.append((k, weakref.ref(t), hooked))
        elif k in region.plan.owned:  # (its position among the Function's outputs, which the recomputation returns)
            retained.append((region.plan.owned.index(k), weakref.ref(t), hooked))
    if escaped and region.plan is None:
        start = len(tensors)
        listed = {id(tensors[k]) for k in region.retained_outputs}
        retained += [
            (start + j, weakref.ref(t), False) for j, t in enumerate(escaped) if t.retains_grad and id(t) not in listed
        ]
    region.retained_grads = tuple(retained)


def nothing_to_differentiate() -> bool:
    """No grad mode, no torch.func grad or jvp level, no forward-mode level: nothing to recompute for
    (``vmap`` alone, or ``functionalize``, under ``no_grad`` or ``inference_mode``)."""
    if torch.is_grad_enabled() or forward_ad_level() >= 0:
        return False
    if not transforms_active():
        return True
    kinds = level_kinds()
    return TransformType.Grad not in kinds and TransformType.Jvp not in kinds


def _in_place_error(name: str) -> CheckpointError:
    return CheckpointError(
        f"remat({name}): the function modified one of its differentiable inputs in place. The "
        "recomputation during the backward pass would start from the modified values and produce "
        "wrong gradients. Compute out of place (y = x + 1, not x.add_(1)) or move the in-place "
        "update outside the remat'd function. A write no graph records (under torch.no_grad or "
        "through .data: a module initializing or rescaling its own weights on its first call, as "
        "Glow's ActNorm does) is undone for the recomputation only in a call that also has a tensor "
        "input that does not require grad: otherwise call the module once before remat'ing it."
    )


def _returned_by_id(tensors: list[torch.Tensor]) -> tuple[dict[int, int], dict[int, int]]:
    """The positions of the outputs that require grad, by id, and the ids of the bases of those that
    are views (not lazy conjugate or negative ones, which ``as_strided`` would not keep), by position.

    By id, as a function (no name of the caller's frame holds an output on past the run's end): a
    tensor alive at the end of the run and one that escaped it (alive since) with the same id are one.
    """
    returned_at: dict[int, int] = {}
    viewing: dict[int, int] = {}
    for k, t in enumerate(tensors):
        if t.requires_grad:
            returned_at[id(t)] = k
            if t._base is not None and not (t.is_conj() or t.is_neg()):
                viewing[k] = id(t._base)
    return returned_at, viewing


def _substituted(tensors: list[torch.Tensor], substitute: Substitute | None) -> list[torch.Tensor]:
    """``fn``'s output tensors, with a captured tensor it returns untouched replaced as its uses are.

    The substitution mode swaps captured tensors only where an operator receives them;
    one returned as it is (``lambda: y`` with ``y`` a closure cell) would otherwise
    leave the region as the caller's own tensor, outside the region's graph.
    """
    if substitute is None or not substitute.mapping:
        return tensors
    swapped = [substitute.mapping.get(id(t), t) for t in tensors]
    if any(s is not t for s, t in zip(swapped, tensors)):
        substitute.hit = True
    return swapped


_SUPPRESSED: Any = object()  # (what a run's output is until fn returns: still so after the with, a context suppressed fn's error)


def _suppressed(name: str) -> CheckpointError:
    return CheckpointError(
        f"remat({name}): a context that context_fn returned suppressed an error the function raised, so "
        "the function returned nothing for remat to differentiate. Let the error through (__exit__ "
        "returning a false value)."
    )


#: Where a tensor keeps the hooks ``register_hook`` and ``register_post_accumulate_grad_hook`` add.
_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _hook_keys(t: torch.Tensor) -> dict[str, set[Any]]:
    return {where: set(getattr(t, where, None) or ()) for where in _HOOK_DICTS}


def _remove_hooks_since(t: torch.Tensor, before: dict[str, set[Any]]) -> None:
    for where in _HOOK_DICTS:
        hooks = getattr(t, where, None)
        if hooks:
            for key in [k for k in hooks if k not in before[where]]:
                del hooks[key]


_TORCHSCRIPT_FAILED = "The following operation failed in the TorchScript interpreter"


def _torchscript_under_transforms_error(name: str, e: Exception) -> CheckpointError:
    """What to say where TorchScript code the function calls failed in a run of a call made under a
    torch.func transform (see :meth:`UserRegion._call_fn`)."""
    said = next((line for line in reversed(str(e).splitlines()) if line.strip()), "")
    return CheckpointError(
        f"remat({name}): TorchScript code the function calls (a torch.jit.script module or function) "
        "failed in remat's run under a torch.func transform. TorchScript's interpreter does not compose "
        "with the torch-function mode remat runs the function under (to route the tensors it reaches: "
        "under a transform TorchScript hands it its operators' tensors unwrapped from the transform's "
        "wrappers), nor does its optimized graph with vmap (it reads .data). Inside the remat'd "
        "function call the Python code that was scripted (the module before torch.jit.script, the "
        "Python function), or remat outside the transform. (TorchScript said: " + (said.strip() or "nothing") + ")"
    )


def _functorch_level_assert(e: Exception) -> bool:
    """Is ``e`` functorch's internal assert on a tensor of a level the running transform does not
    have (a closure tensor of an enclosing transform given to a transform inside the function)?"""
    text = str(e)
    return "INTERNAL ASSERT FAILED" in text and ("wrapped->level() < level" in text or "batched == nullptr" in text)


def _detached_if_made(
    tensors: list[torch.Tensor], made: list[weakref.ref[torch.Tensor]], inputs: tuple[torch.Tensor, ...]
) -> list[torch.Tensor]:
    """``tensors`` with a detached alias of each that a run made (a fresh view of it, for one viewing an input)."""
    made_here = {id(t) for t in (r() for r in made) if t is not None}
    given = {id(t) for t in inputs}
    # (One viewing an input stays a view of it, as another view than the one the run made: that
    # one, also kept, is checked as any other tensor kept, as a view of an input kept is. A view's
    # ``_base`` is the tensor it views at the root, whatever views lie between.)
    return [
        (t.view_as(t) if t._base is not None and id(t._base) in given else t.detach()) if id(t) in made_here else t
        for t in tensors
    ]


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _alive_after_collecting(alive: Callable[[], list[_T]]) -> list[_T]:
    """``alive()``, asked again after a garbage collection where it found anything: a reference
    cycle waiting for the collector is not an escape. (The first answer is let go of first: it
    would hold what it found through the collection.)"""
    found = alive()
    if not found:
        return found
    del found
    gc.collect()
    return alive()


def _traced() -> bool:
    """Is a dispatch mode other than funckpt's own on (``make_fx``'s tracer: ``linearize``,
    ``torch.export``)? It keeps every tensor a run makes, so what outlives the run cannot be told."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    return any(not isinstance(m, (WriteWatch, Replayer, OpTrace)) for m in _get_current_dispatch_mode_stack())


def _refused_by_fullgraph_compile(e: Exception) -> bool:
    """Is ``e`` Dynamo's refusal of a graph break under ``fullgraph=True``?"""
    return type(e).__name__ == "Unsupported" and type(e).__module__ == "torch._dynamo.exc"


def _move_input_hooks(
    leaves: tuple[torch.Tensor, ...], given: tuple[torch.Tensor, ...], name: str, of_a_level: Sequence[bool] | None = None
) -> set[int]:
    """Hooks ``fn`` registered on its inputs (``x.register_hook(...)``) go to the caller's tensors.

    The forward run's inputs are local leaves; a hook there would see only the
    gradient through ``fn``, where without remat it sees the input's whole gradient.
    Returns the indices of the inputs whose hooks moved. (Under ``torch.func`` the
    caller's tensors are at another level: a forward run registers such a hook on the caller's
    tensor itself, see ``Substitute._callers_hook``. Those of an input that was a tensor of the grad
    or jvp level the call was made at, ``of_a_level``, where the forward run went lowered out of it,
    stay with the recomputation: ``given`` is then the tensor under the caller's, which that level's
    backward does not go through, as in a remat'd call nested in another's run at a grad level of
    its own, under ``grad(f)`` of a function reading a module's parameter.)
    """
    moved = set()
    multi: list[tuple[list[Any], list[Any]]] | None = None  # (found once some input has hooks to move)
    for i, (leaf, t) in enumerate(zip(leaves, given)):
        if of_a_level is not None and of_a_level[i]:
            continue
        accumulated = getattr(leaf, "_post_accumulate_grad_hooks", None)
        if accumulated and leaf is not t and t.requires_grad:
            # ``p.register_post_accumulate_grad_hook(...)`` (an optimizer step in the backward pass)
            # on a local leaf would never be called: nothing accumulates into it.
            if t.grad_fn is not None:
                raise CheckpointError(
                    f"remat({name}): the function registered a post-accumulate-grad hook on an input that "
                    "is not a leaf outside the call (torch refuses that: post accumulate grad hooks cannot "
                    "be registered on non-leaf tensors). Register it on the leaf tensor."
                )
            for key, hook in list(accumulated.items()):
                t.register_post_accumulate_grad_hook(FollowingItsHandle(hook, ((accumulated, key),)))  # type: ignore[no-untyped-call]
                accumulated[key] = no_hook
            moved.add(i)
        hooks = getattr(leaf, "_backward_hooks", None)
        if hooks and leaf is not t and t.requires_grad:
            if multi is None:
                multi = _multi_grad_hooks_moved(leaves, given, name, of_a_level)
            for key, hook in list(hooks.items()):
                register_tensor_hook(t, FollowingItsHandle(hook, ((hooks, key),)))
                hooks[key] = no_hook
            moved.add(i)
    for nodes, callers in multi or ():
        nodes[:] = callers
    return moved


def _multi_grad_hooks_moved(
    leaves: tuple[torch.Tensor, ...], given: tuple[torch.Tensor, ...], name: str, of_a_level: Sequence[bool] | None
) -> list[tuple[list[Any], list[Any]]]:
    """For each ``torch.autograd.graph.register_multi_grad_hook`` (``mode="all"``) the function
    registered on its inputs, the list of nodes its hooks count and the caller's nodes to put there.

    Its hooks move to the caller's tensors with the others (:func:`_move_input_hooks`), but they count
    the gradients they wait for by asking the engine whether it will run the nodes of the tensors the
    hook was registered on: the local leaves', which a backward pass through the caller's graph never
    runs (the hook would never call back). With the caller's nodes in their place, it waits for the
    caller's tensors' whole gradients and calls back once, as without remat. Refused where the hook
    also counts a tensor the function computed: that gradient is computed in the recomputation's
    backward pass, another one than the caller's, and no single call could have both."""
    nodes_of: dict[int, tuple[Any, Any]] = {}
    found: dict[int, list[Any]] = {}
    for i, (leaf, t) in enumerate(zip(leaves, given)):
        if (of_a_level is not None and of_a_level[i]) or leaf is t or not t.requires_grad:
            continue
        for hook in (getattr(leaf, "_backward_hooks", None) or {}).values():
            while isinstance(hook, FollowingItsHandle):  # (moved there by a remat'd call nested in this one)
                hook = hook.hook
            nodes = multi_grad_hook_nodes(hook)
            if nodes is not None:
                found[id(nodes)] = nodes
    if not found:
        return []
    for leaf, t in zip(leaves, given):
        if t.requires_grad:
            # (The forward run answers a read of an input's ``grad_fn`` with the caller's tensor's,
            # as torch would give it: the hook may have counted that node already.)
            node = grad_node_of(t)
            nodes_of[id(node)] = (node, node)
            if leaf is not t and leaf.requires_grad:
                own = grad_node_of(leaf)
                nodes_of[id(own)] = (own, node)  # (the key's node held: its id is not reused meanwhile)
    moved = []
    for nodes in found.values():
        if not all(id(node) in nodes_of for node in nodes):
            raise CheckpointError(
                f"remat({name}): the function (or a remat'd call inside it) registered torch.autograd.graph.register_multi_grad_hook on "
                "its inputs together with tensors it computed. remat computes the gradients of those in the "
                "backward pass of its recomputation, apart from its inputs' gradients, so the hook could not "
                "be called once with all of them. Register one hook on the inputs and another on the "
                "tensors the function computed, or register it outside the remat'd call."
            )
        moved.append((nodes, [nodes_of[id(node)][1] for node in nodes]))
    return moved


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


def _grad_checking_missed_paths(
    args: tuple[Any, ...], kwargs: dict[str, Any], others: list[torch.Tensor]
) -> Callable[..., Any] | None:
    """A stand-in for the function's call ``torch.autograd.grad(*args, **kwargs)`` that also takes the
    gradient with respect to ``others`` (inputs computed outside the call from a differentiated one:
    see ``UserRegion.refuse_missed_paths``) in the same backward pass, and raises the error its first
    argument makes unless each is None or zero: the path the remat'd call misses then adds nothing
    to what the function without remat computes. (That pass runs the nodes the function without
    remat runs too: its gradient with respect to the caller's tensor goes through the other input.)

    ``None`` where that cannot be told from the values: a gradient with ``create_graph=True`` (a
    part zero here may have a derivative that is not), or arguments torch would refuse itself."""
    try:
        bound = _GRAD_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return None
    options = bound.arguments
    if options.get("create_graph") or options.get("is_grads_batched"):
        return None
    inputs = options["inputs"]
    single = isinstance(inputs, torch.Tensor)
    wanted = [inputs] if single else list(inputs)
    if not all(isinstance(t, torch.Tensor) for t in wanted):
        return None

    def grad(error: Callable[[], CheckpointError], *_args: Any, **_kwargs: Any) -> Any:
        grads = torch.autograd.grad(
            options["outputs"],
            [*wanted, *others],
            options.get("grad_outputs"),
            retain_graph=options.get("retain_graph"),
            allow_unused=True,
            materialize_grads=bool(options.get("materialize_grads")),
        )
        mine, theirs = grads[: len(wanted)], grads[len(wanted) :]
        # (A gradient None here is one the function without remat gets through the other input:
        # zeros, or the refusal of an unused input, which cannot be told apart without that path.)
        if any(g is None for g in mine) or any(g is not None and _not_all_zero(g) for g in theirs):
            raise error()
        return tuple(mine)

    return grad


def _not_all_zero(t: torch.Tensor) -> bool:
    """Has ``t`` an element that is not zero (NaN included), whichever functorch wrappers it is in?
    (Read off the plain tensor under them, with the transforms off: under vmap a batched tensor's
    value cannot be read.)"""
    with DisableFuncTorch():
        return bool((bottom(t) != 0).any())


def _move_retain_grad(
    leaves: tuple[torch.Tensor, ...], given: tuple[torch.Tensor, ...], substitute: Substitute | None
) -> None:
    """``x.retain_grad()`` that ``fn`` called on an input goes to the caller's tensor.

    The forward run's inputs are local leaves, on which ``retain_grad`` does nothing;
    without remat the caller's (non-leaf) tensor would get its ``.grad``.
    """
    if substitute is None or not substitute.retained:
        return
    for leaf, t in zip(leaves, given):
        if id(leaf) in substitute.retained and leaf is not t and t.requires_grad:
            t.retain_grad()


def _memory_moved(t: torch.Tensor, g: torch.Tensor) -> bool:
    """Does ``t`` hold other memory than ``g``? False where they have none to tell by: FakeTensors
    (under a ``FakeTensorMode``, which warns at a read of their data pointer, and
    ``make_fx(tracing_mode="fake")`` or ``"symbolic"``, where it raises) and other subclasses
    without memory of their own."""
    if type(t) not in PLAIN_TENSORS and (is_fake(t) or is_fake(g)):
        return False
    try:
        return t.data_ptr() != g.data_ptr()
    except RuntimeError:
        return False


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of that shape, of one element's memory (an escaped output nobody held)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _restored(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, keeping ``t``'s derivatives (its graph, its level, its forward-mode tangent)."""
    if t.requires_grad or is_functorch_wrapped(t) or has_tangent(t):
        return t + (value - t).detach()
    return value


def _rebatched(name: str, t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, a copy of the plain tensor under ``t``'s functorch wrappers, batched at each of
    ``t``'s vmap levels as ``t`` is (its grad and jvp wrappers left to :func:`_restored`).

    A snapshot taken under vmap is of the plain tensor under the batched input (the stacked
    buffers of a model ensemble); the recomputation's input is batched over that same tensor,
    at levels of its own (the forward run's vmap has returned by then).
    """
    if not is_functorch_wrapped(t):
        if t.shape != value.shape:
            raise CheckpointError(
                f"remat({name}): the function modified one of its inputs in place under a torch.func "
                "transform that batches it (vmap), and the recomputation receives that input batched "
                f"over a tensor of another shape ({tuple(t.shape)}, not {tuple(value.shape)}); remat cannot "
                "restore its value. Compute out of place, or move the update outside the remat'd function."
            )
        return value
    level = maybe_get_level(t)
    if not is_batchedtensor(t):
        return _rebatched(name, unwrap_one_level(t), value)
    inner, dim = unwrap_batched(t, level)
    assert dim is not None  # (t is batched at its own level)
    value = _rebatched(name, inner, value)
    # Made as a plain construction: dispatched through the levels above this one (a grad level
    # of the recomputation's vjp), the new batched tensor trips functorch's internal assert.
    with DisableFuncTorch():
        return add_batch_dim(value, dim, level)


#: The attributes built-in exception classes keep in their own fields rather than in ``__dict__``
#: (OSError's, UnicodeError's, SyntaxError's, ImportError's, StopIteration's, SystemExit's, NameError's and
#: AttributeError's), and the chaining and notes every exception has.
_EXCEPTION_FIELDS = (
    "errno", "strerror", "filename", "filename2", "winerror", "characters_written",
    "encoding", "object", "start", "end", "reason",
    "msg", "lineno", "offset", "text", "end_lineno", "end_offset", "print_file_and_line",
    "name", "path", "name_from", "obj", "value", "code",
)  # fmt: skip


def _copy_exception_attributes(source: BaseException, target: BaseException) -> None:
    """Give ``target`` (an exception made as a subclass of ``source``'s type) ``source``'s attributes."""
    for name in _EXCEPTION_FIELDS:
        try:
            value = getattr(source, name)
        except AttributeError:  # (not this class's, or unset: characters_written)
            continue
        try:
            setattr(target, name, value)
        except (AttributeError, TypeError, ValueError):
            pass
    try:
        vars(target).update({k: v for k, v in vars(source).items() if k not in ("__notes__",)})
    except TypeError:  # (no __dict__)
        pass


def _too_deep(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], static: tuple[int, ...]) -> ValueError:
    """The error for arguments optree could not flatten for their depth: one that contains itself
    (``l.append(l)``), or a chain of containers deeper than Python's recursion limit."""
    where = "an argument"
    for place, value in [*((f"argument {i}", a) for i, a in enumerate(args) if i not in static), *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]:
        try:
            tree_flatten(value)
        except RecursionError:
            where = place
            break
    return ValueError(
        f"remat({name}): {where} contains itself (a list appended to itself), or containers nested "
        "deeper than Python's recursion limit: remat flattens its arguments (optree) to find their "
        "tensors, and cannot flatten this one. Break the cycle, or pass it through static_argnums "
        "(it is then passed as it is, not searched for tensors)."
    )


def _unflattened_container_holding(t: torch.Tensor) -> type | None:
    """The type of a list, dict or deque subclass that optree does not flatten holding ``t``
    directly (an argument the function wrote it into, ``d[key] = t``), if one does; ``None`` if not.

    remat copies the list, dict and deque arguments optree flattens and carries the function's
    writes into them back to the caller's (see ``UserRegion._container_writes``); one optree does
    not flatten is a leaf, passed as it is, so what the function stores there under a transform is
    a tensor kept outside the call. Asked only to word that refusal (the referrers are searched)."""
    for holder in gc.get_referrers(t):
        kind = type(holder)
        if isinstance(holder, MUTABLE) and kind not in MUTABLE:
            try:
                optree.tree_flatten_one_level(cast(Any, holder), none_is_leaf=True, namespace=NAMESPACE)
            except ValueError:  # (a leaf optree does not enter)
                return kind
    return None


def _stored_in_unflattened(name: str, t: torch.Tensor, kind: type) -> CheckpointError:
    """The error for a tensor the function computed and stored in a ``kind``, a list, dict or deque
    subclass optree does not flatten (see :func:`_unflattened_container_holding`), under a transform."""
    base = next(b for b in MUTABLE if issubclass(kind, b))
    plain = "collections.deque" if base is collections.deque else base.__name__
    return CheckpointError(
        f"remat({name}): a tensor of shape {tuple(t.shape)} that the function computed was stored in a "
        f"{kind.__qualname__}, a {plain} subclass that optree does not flatten (an argument the function wrote "
        "into?), and outlived the call under a torch.func transform. remat carries the function's writes back "
        f"into the list, dict and deque arguments optree flattens, but passes a {kind.__qualname__} as it is, and "
        "cannot give what is stored there a graph in the caller's transform: a gradient through it would be "
        f"silently missing. Pass a plain {plain}, or register {kind.__qualname__} as a pytree node "
        f"(optree.register_pytree_node({kind.__qualname__}, flatten_fn, unflatten_fn, namespace='funckpt')), "
        "or return the tensor from the function (detach it if it is only kept for logging)."
    )


def _two_contexts(context_fn: Callable[[], tuple[Any, Any]], name: str) -> tuple[Any, Any]:
    contexts = context_fn()
    if not (
        isinstance(contexts, (tuple, list))
        and len(contexts) == 2
        and all(hasattr(type(c), "__enter__") and hasattr(type(c), "__exit__") for c in contexts)
    ):
        raise TypeError(
            f"remat({name}): context_fn must return a tuple of two context managers "
            f"(forward, recomputation), got {contexts!r}"
        )
    return contexts[0], contexts[1]


#: What torch raises for autograd used on tensors that do not require grad, and for autograd's
#: own API inside a torch.func transform (see UserRegion._recomputation_message).
_NOT_REQUIRING_GRAD = (
    "does not require grad and does not have a grad_fn",
    "cannot register a hook on a tensor that doesn't require gradient",
)
_REFUSED_UNDER_TRANSFORMS = "inside of a function being transformed by a functorch transform"


@dataclass
class _Run:
    """What :meth:`UserRegion._running` sets up for one run of ``fn``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    substitute: Substitute | None
    trace: OpTrace | None
    first_node: int
    unsubstituted: bool  # a recomputation left to the modules' places (to be checked after it)


class _OwnParametrizationCache:
    """A run's own ``torch.nn.utils.parametrize.cached()`` cache, while the caller has one on.

    Under ``cached()`` a parametrized module's weight (``W + B @ A``, a LoRA written
    as a parametrization) is computed on its first access and kept in a global dict.
    Computed in a run, that tensor belongs to the run's local graph (or to a
    transform level the run leaves): kept past the call it would be used later with
    no graph to the parameters (refused as an escaped tensor). Computed before the
    call, it is a tensor remat cannot route. So the run starts with an empty cache,
    reuses what it computes itself, and leaves the caller's cache as it found it:
    outside, the parametrization is computed again, with the same value.

    Not the same value where computing it changes the parametrization's own state
    (``parametrizations.spectral_norm`` in training mode: a power-iteration step on
    its buffers): without remat it is computed once in the ``cached()`` block. A forward
    run (given its ``region``) that computes it again where the caller had it already,
    or another remat'd call in the block computed it, is refused (see :meth:`_refuse_stateful`).
    """

    __slots__ = ("cache", "outer", "region", "values", "versions")

    def __init__(self, cache: dict[Any, torch.Tensor], region: UserRegion | None = None) -> None:
        self.cache, self.outer, self.region = cache, dict(cache), region
        # The versions of the parametrizations' own buffers, by module id and name (the forward run's),
        # and their values, to put back if the run is refused (only where the block cached some already).
        self.versions: dict[tuple[int, str], list[int]] = {}
        self.values: list[tuple[torch.Tensor, torch.Tensor]] = []
        if region is not None:
            keep = bool(cache) or (_cached_by_runs[0] is cache and bool(_cached_by_runs[1]))
            for key, buffers in _parametrization_buffers(region).items():
                self.versions[key] = [b._version for b in buffers]
                if keep:
                    with torch.no_grad():
                        self.values += [(b, b.clone()) for b in buffers]

    def __enter__(self) -> None:
        self.cache.clear()

    def __exit__(self, *exc: Any) -> None:
        computed = list(self.cache)
        self.cache.clear()
        self.cache.update(self.outer)
        if self.region is not None and exc[0] is None:
            self._refuse_stateful(computed)

    def _refuse_stateful(self, computed: list[Any]) -> None:
        """Raise if the forward run computed a parametrized tensor, changing its parametrization's own
        state, that without remat would have come from the ``cached()`` block's cache."""
        global _cached_by_runs
        assert self.region is not None
        if _cached_by_runs[0] is not self.cache:  # (torch makes a new dict as the outermost block ends)
            _cached_by_runs = (self.cache, set())
        before = set(self.outer) | _cached_by_runs[1]
        _cached_by_runs[1].update(computed)
        if not self.versions or not before.intersection(computed):
            return
        # (By name: cached()'s key holds the id of the module the parametrization was registered on,
        # which a deepcopy of it keeps.)
        buffers = _parametrization_buffers(self.region)
        changed = {name for (i, name), versions in self.versions.items() if [b._version for b in buffers.get((i, name), ())] != versions}
        for key in before.intersection(computed):
            if key[1] in changed:
                with torch.no_grad():  # (the state as before the call, as it is left without remat)
                    for b, value in self.values:
                        b.copy_(value)
                raise CheckpointError(
                    f"remat({self.region.name}): under torch.nn.utils.parametrize.cached(), the call computed the "
                    f"parametrized '{key[1]}' again, and computing it changes its parametrization's own state "
                    "(spectral_norm's power iteration in training mode): without remat it is computed once in the "
                    "cached() block and then taken from the cache, but a remat'd call computes it in a cache of its "
                    "own (the cached tensor belongs to another call's graph), so the state would advance once more "
                    "per call. Enter cached() inside the remat'd function, or leave it off around the call "
                    "(torch.utils.checkpoint refuses this program too)."
                )


#: The ``cached()`` block's cache in force when remat'd forward runs last computed parametrized tensors,
#: and their keys (see _OwnParametrizationCache._refuse_stateful).
_cached_by_runs: tuple[Any, set[Any]] = (None, set())


def _parametrization_buffers(region: UserRegion) -> dict[tuple[int, str], list[torch.Tensor]]:
    """The buffers of the parametrizations of the modules the region reaches, by the module's id and
    the parametrized name (``original`` aside: the tensor parametrized)."""
    found: dict[tuple[int, str], list[torch.Tensor]] = {}
    for module, _ in region.captured.modules:
        for sub in module.modules():
            lists = getattr(sub, "parametrizations", None)
            if not isinstance(lists, torch.nn.ModuleDict):
                continue
            for name, plist in lists.items():
                found[(id(sub), name)] = [b for n, b in plist.named_buffers() if not n.startswith("original")]
    return found


def _forward_ad_off(*exc: Any) -> None:
    set_fwd_grad_mode(False)


def _script_optimized_again(*exc: Any) -> None:
    set_script_optimized(True)


class _Running:
    """:meth:`UserRegion._running`: enters its contexts in order and leaves them in reverse.

    A plain class rather than ``contextlib.ExitStack`` in a generator: this runs
    twice per remat'd call, where their Python costs more than everything it enters.
    As with ``ExitStack``, every context entered is left, an error in leaving one
    does not keep the others from being left, and a context may suppress an error.
    """

    __slots__ = ("exits", "flat", "forward", "grad", "modes", "reached", "region", "under", "watch")

    def __init__(
        self,
        region: UserRegion,
        flat: tuple[torch.Tensor, ...],
        forward: bool,
        grad: bool,
        modes: Sequence[Any],
        watch: WriteWatch | None,
        under: Any = None,
        reached: Sequence[torch.Tensor] = (),
    ) -> None:
        self.region, self.flat, self.forward, self.grad, self.modes = region, flat, forward, grad, modes
        self.watch, self.under, self.reached = watch, under, reached
        self.exits: list[Callable[[Any, Any, Any], Any]] = []

    def _enter(self, context: Any) -> Any:
        value = type(context).__enter__(context)
        self.exits.append(functools.partial(type(context).__exit__, context))
        return value

    def __enter__(self) -> _Run:
        region, flat, forward = self.region, self.flat, self.forward
        args, kwargs = region.argspec.rebuild([flat[i] for i in region.arg_index])
        replace, mapping = region.replacements([flat[i] for i in region.captured_index])
        first_node = next_sequence_nr()
        try:
            trackers = module_trackers_off()
            if trackers is not None:
                self.exits.append(trackers)
            cache = parametrization_cache()
            if cache is not None:
                # (A forward run nested in a recomputation computes again what the enclosing forward
                # run's computed, whose check counts once: see _OwnParametrizationCache.)
                checked = forward and not in_a_recomputation()
                self._enter(_OwnParametrizationCache(cache, region if checked else None))
            places = None
            if region.captured.modules:
                loop = None if region.recomputes_like_forward else region.name
                run_starts = first_node if region.escapes_allowed else None  # (see reparametrized)
                # (A loop's steps run again in the schedule's order, from other states: not recorded.)
                attributes = None
                if forward and loop is None:
                    attributes = region.rebound_attributes = []
                places = reparametrized(
                    region.captured, replace, keep_rebound=forward, loop=loop, first_node=run_starts, attributes=attributes,
                    written=getattr(region, "snapshots", ()) if attributes is not None else (),
                )
                self._enter(places)
            if region.function_modes:
                # The caller's modes are under whatever the run enters (a context_fn's own modes):
                # pushed back where off (a recomputation, a torch.func transform's forward).
                self._enter(FunctionModesBack(region.function_modes))
            if region.options.context_fn is not None:
                recording = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
                if not forward and region.rng is not None:
                    # What the recomputation's context draws, entering or leaving, is put back too,
                    # as torch.utils.checkpoint's fork_rng does around it: a recomputation leaves the
                    # caller's generators where they were. (The function draws from the forward
                    # run's states all the same: the replay inside restores those.)
                    self._enter(_rng.kept(region.rng))
                self._enter(region._user_context(forward))
                if not forward and recording and not (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
                    raise CheckpointError(
                        f"remat({region.name}): the recomputation context that context_fn returned turned "
                        "gradient recording off (torch.no_grad, inference_mode): the recomputation records the "
                        "graph the gradient is computed from, which would then be missing. Return a "
                        "recomputation context that leaves grad mode as it is (contextlib.nullcontext())."
                    )
            if self.grad:
                grad_was = torch.is_grad_enabled()
                set_grad_enabled(True)
                self.exits.append(lambda *exc: set_grad_enabled(grad_was))
            if region.under_transforms and script_optimized():
                # TorchScript's optimized graphs do not compose with torch.func (see script_optimized):
                # the runs of a call made under a transform run the graphs of the scripted modules and
                # functions they reach unoptimized, the same operators, whose derivatives torch.func
                # sees. (Without remat such code raises under vmap, or gives a zero tangent under jvp,
                # once TorchScript has optimized its graph; remat's runs go under vmap and jvp levels
                # of their own. Also a run lowered into plain autograd: a graph optimized there for
                # inputs requiring grad gives a zero Hessian under torch.func ever after.)
                set_script_optimized(False)
                self.exits.append(_script_optimized_again)
            if region.caller_fwd_grad_enabled and not fwd_grad_enabled() and not forward_mode_active():
                # A Function's forward (the forward run's, a differentiable recomputation's) runs with
                # forward-mode AD off: on again, as at the call, so that a ``forward_ad.dual_level()``
                # the function enters itself gets its tangents, in every run alike. No forward-mode
                # level is active around it, so no tangent of the caller's is computed.
                set_fwd_grad_mode(True)
                self.exits.append(_forward_ad_off)
            if hide_saved_tensors_hooks():  # (the run's internals are not the user's hooks' to pack)
                self.exits.append(restore_saved_tensors_hooks)
            if forward:
                region._capture_state(flat)
            else:
                for context in region._replays():
                    self._enter(context)
            if _autocast.cache_off(region.autocast):
                self.exits.append(_autocast.cache_on)
            # A recomputation substitutes only where the forward run showed it must (see
            # UserRegion._substitutes_again): modules' own tensors are in their places already,
            # unless the places had to be looked up again (the module tree changed since).
            # Its graph is checked after it where it has captured tensors to stand in for, or the
            # forward run could not show its graph ends at its inputs (see UserRegion._left_its_inputs).
            checkable = not forward and (bool(mapping) or region.substitutes_again) and region.graph_checkable(flat)
            # (And where the function reaches tensors it did not at the call: only a use of one is refused.)
            substitutes = (
                forward
                or bool(self.reached)
                or region.recomputation_substitutes(mapping, places is not None and places.by_name, checkable)
            )
            substitute = Substitute(mapping, flat, forward, region.name, first_node, self.watch) if substitutes else None
            if substitute is not None and forward and region.refused:
                substitute.refused = region.refused
            if substitute is not None and forward and region.rng is not None:
                substitute.watch_generators(region.generators, region.generator_found)
            if substitute is not None and not forward and region.followed_hooks:
                substitute.hooks = region.followed_hooks
            if substitute is not None and not forward and region.callers_nodes is not None:
                substitute.callers_nodes = region.callers_nodes
            if substitute is not None and self.reached:
                substitute.reached_since_the_call(self.reached, region.rebound)
            if substitute is None:  # (what a call nested in it may take as an input: see refused_around)
                enter_unwatched(first_node, flat)
                self.exits.append(leave_unwatched)
            unsubstituted = not substitutes and checkable
            # Dropouts draw as at the call (see _draws): the substitution mode redraws them where
            # the kernel differs; without it, a mode of its own does, where the forward run saw
            # one whose mask depends on the layout.
            functorch = region.functorch_draws
            enter_run(functorch)
            self.exits.append(leave_run)
            if substitute is None and region.draws_by_layout and differs_here(functorch):
                self._enter(Redraw())
            if self.under is not None:
                self._enter(self.under)
            if substitute is not None:
                self._enter(substitute)
            for mode in self.modes:
                self._enter(mode)
            # As torch.utils.checkpoint, ``debug`` is decided at the forward run, for both runs: the
            # override of set_checkpoint_debug_enabled is per thread, and a backward pass may run
            # in another (an autograd device thread) or outside the ``with`` that held the forward.
            if forward or region.debug is None:
                region.debug = debug_enabled(region.options.debug)
            trace = self._enter(OpTrace()) if region.debug else None
        except BaseException as e:
            if not self.__exit__(type(e), e, e.__traceback__):
                raise
            raise RuntimeError("funckpt: a context_fn suppressed an error raised while entering the run") from e
        return _Run(args, kwargs, substitute, trace, first_node, unsubstituted)

    def __exit__(self, *exc: Any) -> bool:
        exits, self.exits = self.exits, []
        suppressed = False
        pending: BaseException | None = None
        while exits:
            try:
                if exits.pop()(*exc):
                    suppressed, pending, exc = True, None, (None, None, None)
            except BaseException as e:
                suppressed, pending, exc = False, e, (type(e), e, e.__traceback__)
        if pending is not None:
            raise pending
        return suppressed


#: torch modules whose eval-mode fast path is off while any torch-function mode is on (the
#: forward run's substitution mode): their recomputation runs under it too, and so takes the
#: same path (the fast path's nested tensors give other values at padded positions).
_FAST_PATH_MODULES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder)


class UserRegion(Region):
    """The user's function as a region, with the state one call must replay."""

    # What a region starts with, where a run may set its own value (class attributes: a
    # region is made on every call, and each assignment in __init__ costs there).
    values_reproducible = True  # false where the forward run read memory it allocated uninitialized
    # Did the forward run write into its argument containers with a remat'd call or checkpointed loop
    # nested in it (whose outputs the writes cannot become outputs of the call beside: see forward_run)?
    wrote_beside_nested = False
    retained_outputs: tuple[int, ...] = ()  # positions of the outputs fn called retain_grad() on
    retains_kept = False  # does a tensor kept outside the call retain its grad?
    # Was a hook registered in the forward run (by fn or a call nested in it)? Its recomputations
    # register it again (see registers_hooks_when_recomputed).
    hooks_in_forward_run = False
    plan: _aliasing.Plan | None = None
    planned = False  # did the forward run plan its outputs (_aliasing.plan)?
    # The torch-function modes the caller runs under (a device context, a mode of the user's), which
    # every run of the function runs under: the autograd engine runs a backward pass without them,
    # and under a torch.func transform the Function's forward runs with them off (a mode handling
    # the transform's operator is off while it does).
    function_modes: tuple[Any, ...] = ()
    out_slots: TreeSlots | None = None
    forward_trace: list[str] | None = None
    debug: bool | None = None  # decided by the forward run (see _Running.__enter__)
    rng: _rng.RngState | None = None
    out_differentiable: list[bool] | None = None  # (see forward_run)
    # torch's default dtype at the forward run, which the recomputation's factory calls (torch.ones,
    # linspace, tensor(0.5)) make tensors of (see default_dtype_as_at_the_call).
    default_dtype: torch.dtype | None = None
    _recompute_context: Any = None
    autocast: Sequence[_autocast.AutocastState] = _autocast.OFF
    recompute_under_mode = False  # set when a recomputation without the mode left its inputs
    # (Which inputs required grad at the call, and which were of its innermost level: Region's.)
    # Under a transform: was the caller's innermost level a vmap? (Then the forward run takes no
    # grad level of its own, which would change what autocast does: _forward_run_at_a_grad_level.)
    vmap_innermost_at_call = False
    # Under a transform, the caller's tensors at the call (its levels' wrappers, whose graphs the
    # forward run's lowered inputs do not carry), until the forward run ends: see refuse_missed_paths.
    at_the_call: Sequence[torch.Tensor] | None = None
    _at_a_grad_level = False  # is the forward run under its grad level already?
    _made_at_own_level: list[weakref.ref[torch.Tensor]] | None = None  # (during that run, what it made)
    # The primals of the forward run's own grad level, where it took one above a vmap (not lowered
    # into plain autograd): a recomputation with no grad or jvp level left runs under one too (see run).
    _primals_above_a_vmap: list[int] | None = None
    _taint_at_own_level: Taint | None = None  # (that run's, where a forward-mode derivative flows)
    escapes_live: list[bool] | None = None  # per escaped output: held after the call? (settle_escapes)
    # What the forward run made and is still alive (kept outside the call, or returned), where it
    # records no graph of its own: no closure rebound, for the check before a recomputation
    # (see _refuse_tainted_escapes).
    made_and_kept: Sequence[weakref.ref[torch.Tensor]] = ()
    _reached: Reached | None = None  # (the last recomputation's, for its error to say where: see rebound)
    # The tensors the call reaches that a run it is nested in would refuse, left to that run's
    # substitution rather than taken as inputs (set by prepare: see refused_around).
    refused: dict[int, weakref.ref[Substitute] | None] = {}  # (never written: replaced)
    tainted_escapes: Sequence[weakref.ref[torch.Tensor]] = ()
    # Under a transform: the places in lists and dicts where the forward run's escaped tensors were,
    # which get the Function's outputs standing for them (see _swap_held_for_aliases).
    held_escapes: list[HeldEscape] = []
    # Does a grad or jvp level around the call give the caller its outputs as other tensors (their
    # wrappers), rather than the tensors the forward run returned? (Set by prepare.)
    rewrapped_for_caller = False
    # Was the call made under a torch.func transform? Its runs then run TorchScript's graphs unoptimized
    # (see _Running.__enter__). (Set by prepare.)
    under_transforms = False
    # The plain module attributes the forward run rebound with a tensor place of their module,
    # with their values at the call: a recomputation starts from those (see _capture.reparametrized).
    rebound_attributes: Sequence[tuple[torch.nn.Module, str, Any]] = ()
    draws_by_layout = False  # did the forward run call a dropout whose mask depends on the layout (_draws)?
    # Escaped views of another escaped tensor (h[:, 0] kept beside h): views of that output
    # for the caller, not outputs of their own (see _kept_as_outputs).
    escaped_views: Sequence[weakref.ref[torch.Tensor]] = ()
    # The last calls of the forward run a recomputation need not compute (see _tail).
    tail: _tail.TailPlan | None = None
    # The caller's arguments (positional ones without the static, keyword ones) and its tensors, where
    # they hold containers, until the forward run takes them; and what that run wrote into its copies
    # of those, for the call to carry back (see _container_writes). Neither outlives the call.
    caller_arguments: tuple[tuple[Any, ...], dict[str, Any], tuple[torch.Tensor, ...]] | None = None
    container_writes: list[tuple[Any, list[Any]]] | None = None
    returned_container: Any = None  # (the caller's container whose copy the function returned)
    # The outputs the caller's containers get in place of the tensors the run wrote there (under a
    # transform; a view of an input under plain autograd): by the id of the detached alias the
    # containers hold, its position among the outputs (_outputs_for_written).
    written_made: dict[int, int] | None = None
    written_copies: list[Any] = []  # (the function's copies it wrote into, until _written_made has read them)
    written_before: list[tuple[Any, ...]] = []  # (the caller's entries of those, as they were before the run)
    written_outputs = False  # are some of the Function's outputs such tensors, after those fn returned?

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        options: RematOptions,
        argspec: ArgSpec,
        arg_index: list[int],
        captured: Captured,
        captured_index: list[int],
        differentiable: list[bool],
        outer: Sequence[torch.Tensor],
        objects: Sequence[Any] = (),
    ) -> None:
        self.fn, self.name, self.options = fn, name, options
        # The caller's tensors (arguments and captures), by id: alive for the whole forward run.
        self.outer_ids = frozenset(id(t) for t in outer)
        self.objects = tuple(objects)  # the non-tensor arguments
        self.argspec, self.arg_index = argspec, arg_index
        self.captured, self.captured_index = captured, captured_index
        self.differentiable = differentiable
        self._originals = {id(t): t for t in captured.tensors}
        # Like torch.utils.checkpoint, the forward run executes with the caller's grad mode.
        self.caller_grad_enabled = torch.is_grad_enabled()
        self.caller_fwd_grad_enabled = fwd_grad_enabled()  # (forward-mode AD's own switch, see _Running)
        # Does a dropout here take functorch's kernel? Every run's then does too (see _draws).
        self.functorch_draws = functorch_at_the_call()
        self.out_digest: list[Digest | None] = []
        self.constant: set[int] = set()  # outputs that did not require grad in the forward run's graph
        self.moved_hooks: set[int] = set()  # inputs whose hooks fn registered went to the caller's tensors
        # The forward run's hooks on tensors fn made, whose handles a recomputation's follow (see Substitute.hooks).
        self.followed_hooks: list[tuple[dict[int, Any] | None, int, Handles]] = []
        # The caller's nodes fn read as its inputs' grad_fn, and its hooks there (see CallersNodes).
        self.callers_nodes: CallersNodes | None = None
        # The caller's tensors, at the caller's level, by position, until the forward run ends (see prepare).
        self.callers_tensors: Sequence[torch.Tensor] | None = None
        # The hooks of the modules fn reaches, at the forward run (see training_as_at_the_call).
        self.backward_hooks: list[tuple[torch.nn.Module, tuple[dict[int, Any], ...]]] = []
        # torch's global module hooks at the forward run, where any (see global_module_hooks_as_at_the_call).
        self.global_hooks: GlobalHooks | None = None
        self.unchecked: set[int] = set()  # inputs saved without a version check (see _autograd.setup_context)
        self.used_constants: set[int] = set()  # non-differentiable inputs the forward run read
        # Outputs aliasing inputs or each other are rebuilt as views by the caller
        # (_aliasing.py), except inside vmap, whose batched tensors have no storage.
        self.views_outside = not (transforms_active() and vmap_active())
        self.snapshots: dict[int, torch.Tensor] = {}  # input index -> its value before the forward wrote it
        self.unbatched_snapshots: set[int] = set()  # those copied from under functorch's wrappers (_rebatched)
        self.written_without_grad: set[int] = set()  # differentiable inputs the forward run wrote under no_grad
        self.out_meta: list[tuple[Any, ...]] = []
        policy = options.policy
        self.saved = (
            None
            if policy is None or policy is nothing_saveable
            else Saved(policy, name, user_saved_tensors_hooks() if options.respect_saved_tensors_hooks else None)
        )
        self.generators = [] if argspec.dynamic.plain else [leaf for leaf in argspec.dynamic.leaves if is_generator(leaf)]
        self.generators += captured.generators
        # Does a recomputation need the substitution mode (set by the forward run)? And the
        # forward run's substitutes, which must not outlive it where it does not.
        self.substitutes_again = True
        self.forward_substitutes: list[weakref.ref[torch.Tensor]] = []
        # Tensors that escape the forward run (see _escaped_tensors) become outputs of the region,
        # the last ones, where the region's Function is applied by plain autograd: they are found
        # again in a recomputation at their position among what its operators return.
        self.escapes_allowed = self.escapes_become_outputs and not transforms_active()
        # Under a transform, those a list or dict holds become outputs too (_swap_held_for_aliases):
        # not under forward mode, whose rule runs the function again (appending again where it keeps).
        self.escapes_to_holders = not self.escapes_allowed and self.escapes_become_outputs and not forward_mode_active()
        self.escaped_at: list[int] = []
        self.escape_doubts: list[str | None] = []  # per escaped output (see _doubt)

    def _user_context(self, forward: bool) -> Any:
        """``context_fn``'s first context for the forward run, its second for a recomputation.

        ``context_fn`` is called once per forward run; a recomputation beyond the
        first (a second backward pass) asks it for a fresh pair.
        """
        assert self.options.context_fn is not None
        if forward:
            forward_context, self._recompute_context = _two_contexts(self.options.context_fn, self.name)
            return forward_context
        context = self._recompute_context
        self._recompute_context = None
        return context if context is not None else _two_contexts(self.options.context_fn, self.name)[1]

    def _write_watch(
        self, flat: tuple[torch.Tensor, ...], snapshots_possible: bool, leaves: Container[int]
    ) -> WriteWatch:
        """Snapshot each input before the forward run first writes it.

        The recomputation must start from the values the forward run started
        from (say a buffer that is updated and then read). A write to a
        differentiable input that autograd records raises: the caller's graph
        would not know of it. ``leaves``: the inputs that are leaves of a graph
        this run records (its own, under plain autograd; that of a grad level of
        its own, under vmap or forward mode), whose recorded writes autograd refuses.
        """
        storages: dict[int | None, int] = {}  # storage -> the first input on it
        on_same_storage: dict[int, list[int]] = {}  # that input -> every input on its storage
        for i, t in enumerate(flat):
            key = storage_of(bottom(t))
            if key is not None:
                first = storages.setdefault(key, i)
                on_same_storage.setdefault(first, []).append(i)

        def snapshot(written: list[int]) -> None:
            fresh = [i for i in written if i not in self.snapshots]
            if not snapshots_possible:
                # Under torch.func (vmap's batched tensors, a grad level's wrappers) the inputs have no
                # storage of their own, and the levels they live at are gone by the recomputation: the
                # plain tensors under the wrappers are copied (this watch, a dispatch mode, runs below
                # every transform, where they are what operators write), and a recomputation batches
                # the copies as its own inputs are (_rebatched).
                self.unbatched_snapshots.update(fresh)
                with DisableFuncTorch():
                    self.snapshots.update(zip(fresh, clone_together([bottom(flat[i]) for i in fresh])))
                return
            self.snapshots.update(zip(fresh, clone_together([flat[i] for i in fresh])))

        def before_write(index: int, t: torch.Tensor) -> None:
            # ``t`` is what the operator writes: the input or any view of its storage.
            # Every input on that storage is snapshotted whole, not ``t``.
            written = on_same_storage[index]
            unknown = [i for i in written if self.differentiable[i] and i not in leaves]
            if unknown and (torch.is_grad_enabled() or forward_mode_active()):
                # Whether a graph records this write cannot be told here, below every transform.
                # A plain tensor's version counter tells it after the run (_RematFunction.forward):
                # it moves for a write through the tensor or a view of it, not through ``.data``
                # (a Gemma3n layer clamps its own weight so, under vmap(grad) of its parameters).
                if not all(type(flat[i]) in PLAIN_TENSORS and not is_functorch_wrapped(flat[i]) for i in unknown):
                    raise _in_place_error(self.name)
            else:
                # A write no graph records (under no_grad, or through ``.detach()`` or ``.data``:
                # ``nn.Embedding(max_norm=...)`` renormalizes rows of its weight so), with or
                # without remat; the gradient is that of the operators after it. To a local leaf,
                # every write that reaches here is one: autograd refuses a recorded write to a
                # leaf (or a view of one) before it. Like a buffer's update, it happens once, in
                # the forward run; the recomputation starts from a snapshot and writes that.
                self.written_without_grad.update(i for i in written if self.differentiable[i])
            snapshot(written)

        return WriteWatch(storages, before_write)

    def describe_input(self, index: int, t: torch.Tensor) -> str:
        if any(u is t for u in self.captured.tensors):
            for module, named in self.captured.modules:
                for name, u in named.items():
                    if u is t:
                        return f"{type(module).__name__}'s {name!r} (shape {tuple(t.shape)})"
            return f"a tensor of shape {tuple(t.shape)} that the function reaches through its closure"
        return f"an argument of shape {tuple(t.shape)}"

    def refuse_missed_paths(
        self, local: Sequence[torch.Tensor], given: Sequence[torch.Tensor], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[..., Any] | None:
        """Raise before the forward run's function takes a gradient of its own (``func``, one of
        ``torch.autograd.grad``, ``torch.autograd.backward``, ``Tensor.backward``, with its arguments)
        that remat would compute otherwise than the function without remat.

        The run gets its inputs as ``local`` stand-ins of the caller's tensors ``callers`` (leaves
        of a graph of its own). A gradient it takes with respect to one of them follows the
        function's operations only: where the caller computed another input the differentiated
        outputs depend on (or a tensor the function reaches, a module's parameter under
        ``functional_call``) from the caller's tensor of the differentiated one (``w = W * x.sum()``,
        then ``f(x, w)`` taking ``torch.autograd.grad(h, x)``), the function without remat, whose
        inputs are the caller's tensors, follows the path through that input too: its value, and
        every gradient computed from it, would differ silently. (``torch.utils.checkpoint`` passes
        the caller's tensors.) Asked only where the function differentiates inside itself.
        ``given``: the forward run's inputs as the Function got them (the caller's tensors under
        plain autograd; under a transform, lowered ones, and the caller's are :attr:`at_the_call`).

        Where the missed path's part is zero (the outputs depend on the other input through a dead
        ReLU, ``sign``, a zero ``grad_outputs``), both gradients are the same. For a
        ``torch.autograd.grad`` without ``create_graph`` (its result a constant), what is returned is
        a function to call instead of it, that takes the gradient with respect to the other inputs
        too and raises only where one is not zero (see :func:`_grad_checking_missed_paths`).
        """
        backward = func is not torch.autograd.grad
        if backward and self.under_transforms:
            raise CheckpointError(
                f"remat({self.name}): the function runs a backward pass inside itself (.backward()) under a "
                "torch.func transform. Without remat torch raises there (\"backward() called inside a functorch "
                "transform\"); remat's run of the function is below the transform, where it would run. Take "
                "the gradient inside with torch.autograd.grad (or torch.func.grad/vjp) and return it, or call "
                "backward() outside the transform."
            )
        callers = given if self.at_the_call is None else self.at_the_call
        wrt = _differentiated(func, args, kwargs)
        outputs = _differentiated_outputs(func, args, kwargs)
        stand_ins = {id(t): i for i, t in enumerate(local) if t is not callers[i] and t.requires_grad and t.grad_fn is None}
        if wrt is None:  # (.backward() without inputs: into every leaf the outputs reach)
            positions = set(stand_ins.values())
        else:
            positions = {stand_ins[id(t)] for t in wrt if isinstance(t, torch.Tensor) and id(t) in stand_ins}
        positions = {i for i in positions if callers[i].requires_grad}
        if not positions:
            return None
        # The stand-ins the outputs depend on through the function's graph (their leaves' nodes).
        # (Read off the graph, not by get_gradient_edge, which runs an operator: a policy's recorder would see it.)
        reached = _leaves_reached(o.grad_fn for o in outputs if isinstance(o, torch.Tensor))
        used = [j for j, t in enumerate(local) if id(t) in stand_ins and id(t) in reached]
        missed = [
            (i, j)
            for i in sorted(positions)
            for j in used
            if j != i and callers[j].grad_fn is not None and _reaches(callers[j].grad_fn, callers[i])
        ]
        if missed:
            if func is torch.autograd.grad:
                narrowed = _grad_checking_missed_paths(args, kwargs, [local[j] for j in dict.fromkeys(j for _, j in missed)])
                if narrowed is not None:
                    i, j = missed[0]
                    return functools.partial(narrowed, lambda: self._missed_path_error(func, i, callers[i], j, callers[j]))
            i, j = missed[0]
            raise self._missed_path_error(func, i, callers[i], j, callers[j])
        if backward:
            self._refuse_accumulation_into_stand_ins(local, callers, [i for i in sorted(positions) if i in used])
        return None

    def _missed_path_error(self, func: Any, i: int, wrt: torch.Tensor, j: int, other: torch.Tensor) -> CheckpointError:
        """The error of :meth:`refuse_missed_paths`: the gradient with respect to input ``i`` misses the
        path through input ``j``, which the caller computed from it."""
        return CheckpointError(
            f"remat({self.name}): the function takes a gradient of its own ({_differentiation_name(func)}) "
            f"with respect to {self.describe_input(i, wrt)}, and "
            f"{self.describe_input(j, other)}, which it also uses there, was computed from that "
            "tensor outside the call. "
            "Inside a remat'd call each input is a leaf of its own, so that gradient would miss the path "
            "through the other input, which the function without remat follows: its value (and every "
            "gradient computed from it) would be silently wrong. Pass the tensor it is computed from into "
            "the function and compute the dependent tensor inside it (remat(lambda x, W: f(x, W * "
            "x.sum()))), or take that gradient outside the remat'd call."
        )

    def _refuse_accumulation_into_stand_ins(self, local: Sequence[torch.Tensor], callers: Sequence[torch.Tensor], into: list[int]) -> None:
        """Raise before a backward pass the function runs inside itself accumulates into the ``.grad``
        of the stand-ins at ``into`` (those its outputs reach, of inputs or captured tensors that
        require grad at the caller). Without remat that gradient lands in the caller's tensor's
        ``.grad`` (an argument's, a captured parameter's), where the function and its caller read
        it; remat's stand-ins are leaves of its own, whose ``.grad`` nobody reads: the caller's
        stayed silently None. (Carrying it over exactly would also need the caller's ``.grad`` as
        the stand-in's before the pass, its hooks, and no second accumulation by the
        recomputation.) A backward pass into leaves the function made itself is as without remat."""
        if not into:
            return
        i = into[0]
        raise CheckpointError(
            f"remat({self.name}): the function runs a backward pass inside itself (.backward()) that "
            f"accumulates into the .grad of {self.describe_input(i, callers[i])}. Inside a remat'd call "
            "each input (and each tensor it reaches through its closure or module) is a leaf of remat's "
            "own, so that gradient would never reach the caller's tensor's .grad, which the function "
            "without remat fills: it would be silently missing. Take the gradient inside with "
            "torch.autograd.grad and return it (or use it), or run the backward pass outside the remat'd call."
        )

    def run_fn(self, *args: Any, **kwargs: Any) -> Any:
        """The region's function on its arguments (a loop's region drives its steps instead)."""
        return self.fn(*args, **kwargs)

    def _call_fn(self, args: tuple[Any, ...], kwargs: dict[str, Any], forward: bool, grad_forward: bool) -> Any:
        internal = set_internal(False)
        try:
            return self.run_fn(*args, **kwargs)
        except CheckpointError:
            raise
        except RuntimeError as e:
            if self.under_transforms and str(e).startswith(_TORCHSCRIPT_FAILED):
                raise _torchscript_under_transforms_error(self.name, e) from e
            if _refused_by_fullgraph_compile(e):
                raise CheckpointError(
                    f"remat({self.name}): the function is compiled with torch.compile(fullgraph=True), and "
                    "remat runs it under a torch-function mode of its own (to route the tensors it reaches), "
                    "which Dynamo cannot trace without a graph break. Compile the remat'd function instead, "
                    "torch.compile(remat(f), fullgraph=True), where remat becomes the compiler's own "
                    "checkpoint region, or compile f without fullgraph=True."
                ) from e
            if _functorch_level_assert(e):
                raise CheckpointError(
                    f"remat({self.name}): the function passes a tensor it reaches through its closure (or a "
                    "global, or a partial's argument) that belongs to an enclosing torch.func transform to a "
                    "torch.func transform of its own (torch.func.grad, vjp, jacrev, jvp inside it; a MAML inner "
                    "loop closing over the task's data). Those transforms wrap their arguments themselves, where "
                    "remat cannot route the tensor, and torch's internal check failed. Pass that tensor to the "
                    "remat'd function as an argument: remat(lambda w, x: grad(loss)(w, x))(w, x) (a checkpointed "
                    "loop's step: in its carry)."
                ) from e
            # A forward run recording a graph (its own, or at the grad level of its own under vmap or
            # forward mode) gets its differentiable inputs as leaves: autograd refuses their writes.
            # (torch words it "is being used in an in-place operation" for an operator, "has been
            # used ..." for a custom Function's mark_dirty)
            own_level = forward and self._made_at_own_level is not None
            if (grad_forward or own_level) and "leaf Variable that requires grad" in str(e) and "in-place" in str(e):
                raise _in_place_error(self.name) from e
            if forward or isinstance(e, torch.OutOfMemoryError):
                raise
            raise self._recomputation_raised(e) from e
        except Exception as e:
            if forward:
                raise
            raise self._recomputation_raised(e) from e
        finally:
            set_internal(internal)

    def _recomputation_raised(self, e: Exception) -> CheckpointError:
        """A CheckpointError that is also of ``e``'s type, so ``except type(e)`` still catches it,
        with ``e``'s attributes, so such a handler reads what it would without remat (an
        ``OSError``'s ``errno`` and ``filename``, a ``UnicodeDecodeError``'s ``reason``, an
        attribute the user's exception class sets). Its message is remat's, whatever ``e``'s
        class makes of its attributes in ``str``."""
        try:
            # (BaseException's __str__: e's class may format its own fields instead, OSError's errno
            # and strerror, or nothing at all, UnicodeDecodeError's without its five arguments)
            kind: type[CheckpointError] = type(
                f"CheckpointError[{type(e).__name__}]", (CheckpointError, type(e)), {"__str__": BaseException.__str__}
            )
        except TypeError:  # incompatible layouts: a plain CheckpointError, chained to e
            kind = CheckpointError
        error = kind(self._recomputation_message(e))
        if kind is not CheckpointError:
            _copy_exception_attributes(e, error)
        return error

    def _recomputation_message(self, e: Exception) -> str:
        # The forward run records a local graph of its own where it runs under plain autograd (a
        # Function's forward, below the transforms), where the function's inputs require grad and
        # autograd's API is allowed; a recomputation under a transform sees them as the function
        # without remat does there, which then raises the same.
        # (Only there: under plain autograd the recomputation records its graph as the forward run did.)
        under_transforms = transforms_active() or forward_mode_active()
        if under_transforms and isinstance(e, RuntimeError) and any(m in str(e) for m in _NOT_REQUIRING_GRAD):
            return (
                f"remat({self.name}): {the_recomputation()} raised {type(e).__name__}: {str(e).rstrip('.')}. The "
                "function takes a gradient of its own (torch.autograd.grad, .backward(), a tensor hook) where, "
                "under the torch.func transforms around the call, its inputs do not require grad (torch.func.jvp "
                "or jacfwd with no grad transform above it): without remat it raises the same there (remat's "
                "forward run, which records a graph of its own, let it through). Take the jvp of a function that "
                "is differentiated by a grad transform too (hessian, jacfwd(jacrev(f))), or use torch.func.grad "
                "inside the function."
            )
        if under_transforms and isinstance(e, RuntimeError) and _REFUSED_UNDER_TRANSFORMS in str(e):
            return (
                f"remat({self.name}): {the_recomputation()} raised {type(e).__name__}: {str(e).rstrip('.')}. "
                "torch refuses that inside a torch.func transform, also without remat (remat's forward run, "
                "which records a graph of its own, let it through): use torch.func's transforms inside the "
                "function, or call requires_grad_() outside it."
            )
        if forward_mode_active():
            # Forward-mode AD runs code the forward pass never ran (custom Functions' jvp rules, the
            # operators' tangent formulas): the error may be its own, not a changed state's.
            why = (
                "The recomputation computes the tangents too, with code the forward pass did not run (an "
                "autograd.Function's jvp, which must return a view where its forward does, and read what it "
                "saved with ctx.save_for_forward; an operator without a forward-mode formula): the error may "
                "come from there. Otherwise the function may depend on state that changed since the forward "
                "pass (an exhausted iterator, a counter, a global): pass such values as tensors."
            )
        else:
            why = (
                "The function must compute the same thing when called again with the same inputs: it may "
                "depend on state that changed between the forward and the backward pass (an exhausted "
                "iterator or generator, a counter, a global, a module attribute). Pass such values as "
                "tensors, or compute them outside the remat'd function."
            )
        return f"remat({self.name}): {the_recomputation()} raised {type(e).__name__}: {e} where the forward pass did not. {why}"

    def reached_since_the_call(self) -> list[torch.Tensor]:
        """The differentiable tensors the function reaches now and did not at the call (see
        :func:`changed_captures`): a recomputation refuses a use of one (:meth:`rebound`)."""
        made = (t for r in self.made_and_kept if (t := r()) is not None)
        reached = changed_captures(self.fn, self.captured, made)
        self._reached = reached
        return reached

    def rebound(self, t: torch.Tensor) -> CheckpointError:
        """The error of a recomputation that used ``t``, a tensor the function reaches now and did not at
        the call, or not there (see :func:`changed_captures`)."""
        return rebound_error(
            f"remat({self.name})", "the function", t, "Pass such tensors to the remat'd function as arguments", self._reached
        )

    def _refuse_reached_returned(self, tensors: list[torch.Tensor], reached: list[torch.Tensor]) -> None:
        """Raise if a recomputation returned as it is a tensor it reached only since the call (a closure
        tensor returned untouched, rebound since): no operator received it, for the mode to refuse."""
        ids = {id(t) for t in reached}
        used = [t for t in tensors if id(t) in ids]
        if used:
            raise self.rebound(used[0])

    def unchecked_inputs(self) -> set[int]:
        return self.unchecked

    def checked_constants(self) -> set[int]:
        return self.used_constants

    def outputs_share_no_input_storage(self) -> bool:
        # Where the forward run planned its outputs, every output sharing an input's
        # storage became a view the caller rebuilds (or a copy): none is returned here. Not the
        # tensors the run wrote into the caller's containers, outputs of their own (see
        # _outputs_for_written), which may view an input or the memory of another output.
        return self.planned and not self.written_outputs

    def _refuse_differentiable_writes(self, flat: tuple[torch.Tensor, ...]) -> None:
        """Raise if the forward run wrote a differentiable value into an input that had none.

        ``buf[:, :2] = x @ w`` on a buffer argument puts the caller's ``buf`` into the
        graph without remat; with it the write lands on the caller's tensor but its
        graph stays in the forward run, so a gradient through ``buf`` would be missing.
        """
        written = [i for i, t in enumerate(flat) if t.requires_grad and not self.differentiable[i]]
        if written:
            shape = tuple(flat[written[0]].shape)
            raise CheckpointError(
                f"remat({self.name}): the function wrote a value that requires grad into one of its inputs "
                f"that does not (shape {shape}) in place; remat cannot give the caller's tensor that graph, "
                "so a gradient through it would be missing. Build a new tensor instead (torch.cat, "
                "torch.where, or buf.clone() before writing) and return it."
            )

    def constant_outputs(self) -> set[int]:
        return self.constant

    def release_kept(self) -> None:
        if self.saved is not None:
            self.saved.release()

    def note_inputs_changed_by_hooks(self) -> None:
        self.values_reproducible = False  # (the determinism check still compares shapes and dtypes)

    def note_mutated_inputs(self, indices: list[int]) -> None:
        if any(self.differentiable[i] and i not in self.written_without_grad for i in indices):
            raise _in_place_error(self.name)
        # Non-differentiable inputs (buffers such as BatchNorm's running statistics)
        # are updated once, by the forward run; the write watch snapshotted them
        # before the first write and recomputations start from a copy of that.
        # (In-place views such as unsqueeze_ and resize_ are snapshotted before they run too.)
        # One changed without a snapshot (through a storage the watch cannot see) cannot be restored.
        missed = [i for i in indices if i not in self.snapshots]
        if missed:
            raise CheckpointError(
                f"remat({self.name}): the function modified {len(missed)} of its inputs in place in a way "
                "remat cannot undo for the recomputation (a change its write watch did not see: remat "
                "copies an input before a torch function or operator writes it, and this write announced "
                "itself to neither, as x.set_(...), a complex tensor's .real or .imag setter, a C++ "
                "extension's own binding or code under torch._C.DisableTorchFunction may write). "
                "Compute out of place, or move the update outside the remat'd function."
            )

    def _refuse_hidden_tensors(self, leaves: tuple[Any, ...], plain_autograd: bool) -> None:
        """Raise if a non-tensor output leaf holds a tensor whose gradient would be lost.

        optree does not look inside types it does not know (a plain class, a
        returned closure), so a tensor held there is not an output of the autograd
        Function: a gradient through it would be silently missing, or would reach
        remat's own copy of an input instead of the caller's tensor. Tensors the
        caller passed in or fn captured are fine (returned as they are), and so are
        tensors no gradient can flow through: integer ones, and under plain autograd
        those that do not require grad. Under a torch.func transform the forward
        run cannot tell, so every other floating-point tensor is refused.
        """
        for leaf in leaves:
            if type(leaf) in weakref.ProxyTypes:
                continue  # it keeps nothing alive (and a dead one raises on any use)
            if leaf is None or isinstance(leaf, (str, bytes, int, float, complex, torch.dtype, torch.device)):
                continue
            hidden = [
                t
                for t in tensors_inside(leaf)
                if id(t) not in self.outer_ids
                and has_gradient_dtype(t)
                and (t.requires_grad or not plain_autograd)
            ]
            if hidden:
                shape, kind = tuple(hidden[0].shape), type(leaf).__qualname__
                if isinstance(leaf, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
                    raise CheckpointError(
                        f"remat({self.name}): the function returned a {kind} (it is a generator or async "
                        "function, whose body runs when the result is iterated or awaited, after the remat'd "
                        f"call, on remat's own copies of its inputs, of shape {shape} among them): remat "
                        "would checkpoint nothing, and gradients would miss the caller's tensors. Remat the "
                        "code that consumes it, or return a list or tuple of the tensors instead."
                    )
                if callable(leaf) and not isinstance(leaf, torch.nn.Module):
                    raise CheckpointError(
                        f"remat({self.name}): the function returned a callable ({kind}) that holds a tensor "
                        f"of shape {shape} computed or received inside the remat'd call; a gradient through "
                        "it would be silently missing or reach remat's internal copy of an input. Return "
                        "the tensor itself, or have the callable take it as an argument."
                    )
                raise CheckpointError(
                    f"remat({self.name}): the function returned a tensor of shape {shape} inside a {kind}, "
                    f"a type optree does not flatten, so a gradient through it would be silently missing. "
                    f"Register {kind} as a pytree node (optree.register_pytree_node({kind}, flatten_fn, "
                    "unflatten_fn, namespace='funckpt')), return the tensor in a tuple, list, dict or "
                    "namedtuple, or detach it if no gradient should flow through it."
                    + (" For a transformer's key/value cache, call the model with use_cache=False." if "Cache" in kind else "")
                )

    def _watch_containers(
        self, caller: tuple[tuple[Any, ...], dict[str, Any], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[Any, Any, tuple[Any, ...], tuple[Any, ...]]]:
        """Each list, dict and deque among the caller's arguments, the function's copy of it, the
        copy's entries before the run and the caller's (static arguments are passed as they are:
        not copies)."""
        static = self.argspec.static
        dynamic = tuple(a for i, a in enumerate(args) if i not in static) if static else args
        return [
            (mine, copy, _shallow(copy), _shallow(mine))
            for mine, copy in argument_containers(caller[:2], (dynamic, kwargs))
        ]

    def _container_writes(
        self,
        watched: list[tuple[Any, Any, tuple[Any, ...], tuple[Any, ...]]],
        outer: tuple[torch.Tensor, ...],
        flat: tuple[torch.Tensor, ...],
    ) -> list[tuple[Any, list[Any]]] | None:
        """What the function wrote into its copies of the caller's containers, for the call to
        write into the caller's (:func:`run_prepared`): ``None`` where it wrote nothing.

        remat passes the function copies of its argument containers (optree rebuilds them
        around remat's own tensors), so a write (``outs.append(h)``, ``aux["loss"] = l``, timm
        VoVNet's ``concat_list.append(conv(x))``) would otherwise be lost. Carried back, each
        entry is what the caller would hold without remat: its own tensor where the function
        wrote one of its inputs (remat gave it a copy), its own container where one of the
        copies; a tensor the run computed is kept outside the call as one in any other place is
        (under plain autograd an output of the Function, its gradient flowing as without remat:
        :meth:`_escaped_tensors`; under a torch.func transform an output as well, which the
        caller's container gets in its place: :meth:`_outputs_for_written`). A checkpointed loop's
        steps, which run again one at a time, write nothing back.

        Where the write cannot be the caller's as without remat, it raises: a container passed at
        two places (the function gets two copies: what it wrote into one, it would not read from
        the other), or one the function also wrote itself, through a closure or a global (the
        copy's entries would overwrite those writes).
        """
        if not self.escapes_become_outputs:
            return None  # (a checkpointed loop's: its steps' writes into the carry they get are their own, as in JAX)
        written = [(mine, copy, theirs) for mine, copy, before, theirs in watched if _written(before, _shallow(copy))]
        if not written:
            return None
        places = collections.Counter(id(mine) for mine, *_ in watched)
        if any(places[id(mine)] > 1 for mine, *_ in written):
            raise CheckpointError(
                f"remat({self.name}): the function added, removed or replaced an entry of a list or dict it "
                "was passed twice (as two arguments, or twice inside one): remat passes each its own copy, "
                "so what the function wrote into one it would not read from the other, and the caller's "
                "could not be kept as without remat. Pass it once."
            )
        reached = _reached_directly(self.fn)
        if any(_written(theirs, _shallow(mine)) or id(mine) in reached for mine, _, theirs in written):
            raise CheckpointError(
                f"remat({self.name}): the function added, removed or replaced an entry of a list or dict it "
                "was passed, and reaches or wrote the caller's own as well (through its closure, a global or "
                "an attribute): remat passes the function a copy, whose writes the caller's gets after the "
                "call, so the function would read the caller's as it was, and what it wrote there would be "
                "lost. Use it through one of the two only (or pass it through static_argnums if it holds no "
                "tensor remat must route)."
            )
        back: dict[int, Any] = {id(t): mine for t, mine in zip(flat, outer)}  # each input, as the caller passed it
        back.update((id(copy), mine) for mine, copy, *_ in watched)  # each container, the caller's own

        def carried(v: Any) -> Any:
            mine = back.get(id(v))
            return map_back(v, back) if mine is None else mine

        self.written_copies = [copy for _, copy, _ in written]  # (see _written_made)
        self.written_before = [theirs for _, _, theirs in written]
        writes: list[tuple[Any, list[Any]]] = []
        for mine, copy, _ in written:
            if isinstance(copy, dict):
                writes.append((mine, [(k, carried(v)) for k, v in copy.items()]))
            else:
                writes.append((mine, [carried(v) for v in copy]))
        return writes

    def _written_made(
        self, tensors: list[torch.Tensor], made: list[weakref.ref[torch.Tensor]], taint: Taint | None, flat: tuple[torch.Tensor, ...]
    ) -> list[tuple[int, torch.Tensor, int | None]]:
        """The tensors the run computed, carrying a derivative, and wrote into its copies of the
        caller's containers: each with its position among those the run's operators returned and,
        where the function also returns it, among the outputs. (``taint``: what carries one where
        the run records no graph that shows it.) Under plain autograd, the views of its inputs only
        (``outs.append(x.t())``): autograd points the others at the Function's node as they are
        (:meth:`_escaped_tensors`), but a view of remat's stand-in for an input has no graph
        there.

        Not asked where remat'd calls nested in the run took positions too: a recomputation below a
        vmap (``jacrev``) runs those otherwise, and the positions would not be the forward run's.
        Those tensors are then checked as any other kept outside the call (and refused)."""
        position: dict[int, int] = {}
        for k, r in enumerate(made):
            t = r()
            if t is not None:
                position.setdefault(id(t), k)
        returned: dict[int, int] = {}
        for j, t in enumerate(tensors):
            returned.setdefault(id(t), j)
        assert self.container_writes is not None
        found: dict[int, tuple[int, torch.Tensor, int | None]] = {}
        inputs = {id(t) for t in flat} if self.escapes_allowed else None
        # Only the entries the run added or replaced: the caller's own, as they were (a log of every
        # earlier step's tensors), hold nothing the run made, and would use up the walk's budget.
        theirs = {id(e.value if type(e) is _Item else e) for entries in self.written_before for e in entries}
        new = [
            v
            for mine, content in self.container_writes
            for v in ((v for _, v in content) if isinstance(mine, dict) else content)
            if id(v) not in theirs
        ]
        for t in tensors_inside(new, budget=10_000, into_modules=False):
            if id(t) not in position or id(t) in found or not (t.requires_grad or (taint is not None and taint.holds(t))):
                continue
            if inputs is None or (t._base is not None and id(t._base) in inputs):
                found[id(t)] = (position[id(t)], t.detach(), returned.get(id(t)))
        copies = self.written_copies
        if not found:
            return []
        # The containers hold detached aliases from here on: the tensors the function wrote hold the
        # run's graph, and with it what its operators saved, which would look kept outside the call.
        back = {key: alias for key, (_, alias, _) in found.items()}
        self.container_writes = [(mine, [map_back(v, back) for v in content]) for mine, content in self.container_writes]
        for copy in copies:
            _fill(copy, [map_back(v, back) for v in _shallow(copy)])
        return list(found.values())

    def _outputs_for_written(self, tensors: list[torch.Tensor], written: list[tuple[int, torch.Tensor, int | None]]) -> list[torch.Tensor]:
        """``tensors`` and, as outputs of their own, the tensors the run computed and wrote into its
        copies of the caller's containers (:meth:`_written_made`).

        Under a torch.func transform the function's tensors are not the caller's (the Function's
        outputs are other tensors, wrapped at the caller's level), nor under plain autograd is a
        view of remat's stand-in for an input: kept as the function wrote them, their gradient
        would be missing. As outputs of the Function, the caller's containers get those instead
        (:func:`run_prepared`), as a tensor kept outside the call becomes an output under plain
        autograd (:meth:`_escaped_tensors`); the recomputation computes them again, found by their
        position among the tensors its operators return. One the function also returns is that
        output, as without remat (where the outputs are as it returned them)."""
        self.written_made = {}
        extra: list[tuple[int, torch.Tensor]] = []
        for k, t, j in written:
            if j is not None:
                # Where outputs view one another (a plan), the caller's tensor is rebuilt from the
                # Function's (encoded -j - 1 for run_prepared): as a separate output, sharing its memory
                # unseen, a write through one (``outs[0].mul_(2)``) missed the other's gradient.
                self.written_made[id(t)] = j if self.plan is None else -j - 1
            else:
                self.written_made[id(t)] = len(tensors) + len(extra)
                extra.append((k, t))
        if extra:  # (after those kept elsewhere, under plain autograd)
            # (Separate outputs, each one, where one may view another's memory, or an input's: the
            # Function makes those of an input its views, and refuses a write into shared memory
            # in the backward pass, as it does where no plan is made.)
            self.written_outputs = True
            self.tail = None  # (the recomputation's must have values)
            self.escaped_at = [*self.escaped_at, *(k for k, _ in extra)]
            self.escape_doubts = [*self.escape_doubts, *[None] * len(extra)]
        return [*tensors, *(t for _, t in extra)]

    #: Do tensors escaping the forward run become outputs (a loop's region reverses its steps
    #: without recomputing the loop as a whole: there they are refused)?
    escapes_become_outputs = True

    def escaped_outputs(self) -> int:
        return len(self.escaped_at)

    def registers_hooks_when_recomputed(self) -> bool:
        return self.hooks_in_forward_run

    def _escaped_tensors(
        self,
        substitute: Substitute,
        inputs: tuple[torch.Tensor, ...],
        marks: list[tuple[Saved, int]],
        returned: dict[int, int] | None = None,
    ) -> list[tuple[int, torch.Tensor]]:
        """The tensors the forward run computed that outlive its local graph other than as outputs.

        A forward hook that appends a submodule's output to a list (HF's
        ``output_attentions``/``output_hidden_states``/``output_router_logits``), a
        global, a module attribute (an MoE layer's auxiliary loss): such a tensor's
        graph ends inside the run, at remat's own copies of the inputs. Checked once
        the run's graph is dropped: what is still alive then is held from outside
        (with what its graph saved). An enclosing region whose policy keeps values
        holds some of this run's tensors (``marks``: where its trace stood when this
        run began), with this run's graph attached: that is let go of first, as that
        region would at its end.

        Under plain autograd they become outputs of the region's Function too: autograd
        then points those very tensors at its node, as ``torch.utils.checkpoint`` would
        leave them in the caller's graph, and a recomputation finds them again by
        their position among the tensors its operators return (``Substitute.keep``).
        Returned with their positions. Under a torch.func transform (whose tensors the
        Function cannot rebind) and in a checkpointed loop they raise.
        """
        detach_kept_since(marks)
        made = substitute.made or []
        substitute.made = None
        # An operator may return its input itself (x.to(x.dtype), eval-mode dropout): not made here.
        given = {id(t) for t in inputs}

        def alive() -> list[tuple[int, torch.Tensor]]:
            # A tensor returned again (an in-place operator's result, a nested region's output
            # that escaped it) is found at the first position it was returned at.
            found: dict[int, tuple[int, torch.Tensor]] = {}
            for k, r in enumerate(made):
                t = r()
                if t is not None and t.requires_grad and id(t) not in given:
                    found.setdefault(id(t), (k, t))
            return list(found.values())

        if not self.escapes_allowed and _traced():
            # A tracer (make_fx: torch.func.linearize, torch.export) may keep what the run made alive
            # (torch 2.14's does, under torch.func): what outlived the run cannot be told there.
            return []
        escaped = alive() if self.escapes_allowed else _alive_after_collecting(alive)
        held = held_by_recording_regions() if escaped else set()
        if escaped:
            escaped = [(k, t) for k, t in escaped if id(t) not in held]
        if not escaped:
            return []
        if self.escapes_to_holders and not substitute.made_nested:
            # Under a transform: those a list or dict holds become outputs, which it gets in their place.
            positions = {id(t): k for k, t in escaped}
            refs = [weakref.ref(t) for _, t in escaped]
            del escaped
            self.held_escapes = self._swap_held_for_aliases(refs, positions, held, given, returned or {})
            escaped = _alive_after_collecting(alive)
            escaped = [(k, t) for k, t in escaped if id(t) not in held]
            if not escaped:
                return []
            self._undo_held_swaps()
        # The last one made: the others alive are most likely what its graph saved.
        shape = tuple(escaped[-1][1].shape)
        if not self.escapes_allowed:
            explained = self._escape_explained(escaped[-1][1]) if self.escapes_become_outputs else None
            if explained is not None:
                raise explained
            where = "in a step of a checkpointed loop" if not self.escapes_become_outputs else "under a torch.func transform"
            raise CheckpointError(
                f"remat({self.name}): a tensor of shape {shape} that the function computed outlived the call "
                f"other than as its return value {where} (kept by a forward hook, a list or dict it appends "
                "to, a global, or a module attribute; HF's output_attentions, output_hidden_states and "
                "output_router_logits do this, and its key/value cache unless the model is called with "
                "use_cache=False). remat cannot give it a graph in the caller's "
                f"{'loop' if not self.escapes_become_outputs else 'transform'}, so a gradient through it "
                "would be silently missing. Return it from the function, or detach it if it is only kept "
                "for logging (use_cache=False for a key/value cache)."
            )
        return escaped

    def _swap_held_for_aliases(
        self,
        refs: list[weakref.ref[torch.Tensor]],
        positions: dict[int, int],
        held: set[int],
        given: set[int],
        returned: dict[int, int],
    ) -> list[HeldEscape]:
        """Under a torch.func transform: put a detached alias in place of each escaped tensor that a
        list or dict holds (transformers' output recorder's lists, which its forward hooks append
        attention weights and router logits to; a module's ``__dict__``), and return those places,
        each with its alias, the tensor's position among those the run's operators returned, and
        among the outputs where the function also returns it.

        Under plain autograd such a tensor becomes an output of the Function as it is (autograd
        points it at the Function's node: :meth:`_escaped_tensors`). Under a transform the caller's
        tensors are others (the Function's outputs, wrapped at the caller's level), so remat makes
        it an output as well and puts that output in its place once the Function is applied
        (:func:`run_prepared`), as it does for a list the function was passed
        (:meth:`_outputs_for_written`). The holders are found by the garbage collector's referrers
        (asked only here, where the call would raise otherwise); what else keeps a tensor (a tuple,
        a frame, a subclass of list or dict, any other object) leaves it alive, and the call refuses
        it as before.
        """
        found = [t for r in refs if (t := r()) is not None and id(t) not in held]
        if not found or any(self._doubt(t, given) is not None for t in found):
            return []  # (a leaf the function made: refused, as it is under plain autograd once held)
        ids = {id(t) for t in found}
        aliases: dict[int, torch.Tensor] = {}
        slots: list[tuple[Any, Any, torch.Tensor]] = []
        for holder, key in _places_holding(found, ids):
            t = _get_place(holder, key)
            alias = aliases.get(id(t))
            if alias is None:
                alias = aliases[id(t)] = t.detach()
            _set_place(holder, key, alias)
            slots.append((holder, key, t))
        del found
        # (The tensors themselves are let go of: only their aliases, and the places, are kept.)
        return [
            HeldEscape(holder, key, aliases[id(t)], positions[id(t)], returned.get(id(t)), weakref.ref(t))
            for holder, key, t in slots
        ]

    def _held_at_own_level(
        self, made: list[weakref.ref[torch.Tensor]], tensors: list[torch.Tensor], flat: tuple[torch.Tensor, ...]
    ) -> list[tuple[int, torch.Tensor, int | None]]:
        """Under a grad level of the run's own (``vmap(grad(f))``: see _forward_run_at_a_grad_level),
        before it ends: the tensors the run computed that a list or dict keeps, swapped for aliases
        (:meth:`_swap_held_for_aliases`), as entries for :meth:`_outputs_for_written`. What else
        keeps one is refused once the level ends (:meth:`_refuse_escapes_of_the_level`), and so is
        one where every such tensor is also one the level's graph saved (HF's attention weights,
        which the matmul with the values saves): while the level lasts, those cannot be told from
        what the graph alone keeps alive without the referrers of every tensor it saved."""
        returned: dict[int, int] = {}
        for j, t in enumerate(tensors):
            returned.setdefault(id(t), j)
        given = {id(t) for t in flat}

        def alive() -> list[tuple[int, torch.Tensor]]:
            found: dict[int, tuple[int, torch.Tensor]] = {}
            for k, r in enumerate(made):
                t = r()
                if t is not None and t.requires_grad and id(t) not in given and id(t) not in returned:
                    found.setdefault(id(t), (k, t))
            return list(found.values())

        escaped = _alive_after_collecting(alive)
        # Inside the level its graph holds what its operators saved (alive too): the referrers are
        # asked only where one is held by nothing else (no tensor of the graph holds it), the cost
        # of a walk over every object being for a call that raises otherwise.
        if not any(cast(Any, t)._use_count() == 1 for _, t in escaped):
            return []
        held = held_by_recording_regions()
        positions = {id(t): k for k, t in escaped}
        refs = [weakref.ref(t) for _, t in escaped]
        del escaped
        self.held_escapes = self._swap_held_for_aliases(refs, positions, held, given, returned)
        return [(h.position, h.alias, h.returned) for h in self.held_escapes]

    def _undo_held_swaps(self) -> None:
        """Put back the tensors :meth:`_swap_held_for_aliases` took, where something else keeps them
        alive (the call raises: they stay as the function left them)."""
        slots, self.held_escapes = self.held_escapes, []
        for slot in slots:
            t = slot.tensor()
            if t is not None and _place_holds(slot.holder, slot.key, slot.alias):
                _set_place(slot.holder, slot.key, t)

    def _kept_as_outputs(
        self,
        escaped: list[tuple[int, torch.Tensor]],
        tensors: list[torch.Tensor],
        returned: dict[int, int],
    ) -> list[tuple[int, torch.Tensor]]:
        """``escaped`` without those the caller gets otherwise, as without remat.

        * A tensor ``fn`` both returns and keeps (``log.append(h); return h``): the Function
          returns that very tensor (``tensors`` holds a detached alias of it until now), so
          the caller's result and what it kept are one tensor, as without remat, and an
          in-place update of one is recorded for the other.
        * A view of an escaped or returned tensor (a forward hook keeping ``out[:, 0]`` keeps
          ``out`` alive as its ``_base``): as an output of its own it would be one of a node
          with several outputs, which autograd refuses to update in place (without remat the
          caller may). It stays a view of its base, which is the output:
          :meth:`point_kept_views`, after the call, points its graph there.
        """
        kept: list[tuple[int, torch.Tensor]] = []
        outputs: set[int] = set()
        for k, t in escaped:
            k_returned = returned.get(id(t))
            if k_returned is not None and t.grad_fn is not None:
                tensors[k_returned] = t
                outputs.add(id(t))
            else:
                kept.append((k, t))
        bases = outputs | {id(t) for _, t in kept}
        views = [t for _, t in kept if t._base is not None and id(t._base) in bases]
        # Not one of several views an operator returned together (``h.unbind(0)[1]``), nor any
        # other view of its base: autograd cannot make such a view's grad_fn again from its base's
        # once the base's version moves (which points the others at the Function), and would
        # refuse every later use of it. Without remat the caller may not update it in place
        # either: it is an output of its own, and so are the other views of its base.
        together = {id(t._base) for t in views if get_creation_meta(t) == CreationMeta.MULTI_OUTPUT_NODE}
        views = [t for t in views if id(t._base) not in together]
        if views:
            self.escaped_views = [weakref.ref(t) for t in views]
            apart = {id(t) for t in views}
            kept = [(k, t) for k, t in kept if id(t) not in apart]
        return kept

    def _outputs_viewing_kept(
        self, tensors: list[torch.Tensor], escaped: list[tuple[int, torch.Tensor]], viewing: dict[int, int]
    ) -> list[torch.Tensor]:
        """The Function's outputs without the returned views of an escaped tensor (``log.append(h);
        return h[:, 0]``): the caller gets them as views of that output, as without remat, where an
        in-place update of ``h`` after the call is in the graph of the view too. (``viewing``: the
        ids of the bases of the Function's outputs, by their index, as the run made them.)"""
        n_owned = len(self.plan.owned) if self.plan is not None else len(tensors)
        at = {id(t): j for j, (_, t) in enumerate(escaped)}
        moved = {k: at[b] for k, b in viewing.items() if k < n_owned and b in at}
        if not moved:
            return tensors
        plan = self.plan or _aliasing.Plan(tuple([None] * n_owned), tuple(range(n_owned)), frozenset())
        views = list(plan.views)
        past = len(views) + len(plan.bases)  # (the escaped outputs come after the hidden bases)
        for k, j in moved.items():
            views[plan.owned[k]] = _aliasing.view_of(past + j, tensors[k], escaped[j][1])
        kept = [k for k in range(len(tensors)) if k not in moved]
        self.constant = {n for n, k in enumerate(kept) if k in self.constant}
        self.plan = _aliasing.Plan(
            tuple(views), tuple(plan.owned[k] for k in kept if k < n_owned), plan.copied, plan.bases
        )
        return [tensors[k] for k in kept]

    def _doubt(self, t: torch.Tensor, given: set[int]) -> str | None:
        """Why ``t``, an escaped tensor, cannot be right if someone outside the call holds it.

        Asked of every escaped tensor, but only held ones raise (:meth:`settle_escapes`):
        the others are what a held one's graph saved (an input's view ``w.t()`` that a
        matmul saved), which go with that graph.
        """
        if t.grad_fn is None:
            return (
                f"a tensor of shape {tuple(t.shape)} that the function created to require grad itself (a "
                "leaf: torch.zeros(..., requires_grad=True), x.detach().requires_grad_()) outlived the call "
                "other than as its return value (kept by a forward hook, a list, a global or a module "
                "attribute). Its .grad would miss what flows into it through the call, which remat "
                "differentiates in its recomputation. Create it outside the function and pass it in, or "
                "return it."
            )
        if t._base is not None and id(t._base) in given:
            return (
                f"a view of one of the function's inputs (shape {tuple(t.shape)}) outlived the call other "
                "than as its return value (kept by a forward hook, a list, a global or a module attribute). "
                "remat's copy of the input it views has no graph in the caller's autograd, so a gradient "
                "through it would be silently missing. Return it from the function, or keep a view taken "
                "outside the call."
                + (
                    " (The function wrote into a list, dict or deque it was passed, with a remat'd call or a "
                    "checkpointed loop (funckpt.scan, fori_loop, while_loop) nested in it: there remat cannot "
                    "make such a view an output of the call, as it does without the nested one.)"
                    if self.wrote_beside_nested
                    else ""
                )
            )
        return None

    def point_kept_views(self) -> None:
        """After the call: the escaped views of the Function's outputs (see :meth:`_kept_as_outputs`)
        become views of them for autograd too."""
        views = [v for v in (r() for r in self.escaped_views) if v is not None]
        self.escaped_views = ()
        for base in {id(v._base): cast(torch.Tensor, v._base) for v in views}.values():
            # The base's graph is now the Function's node: a view's grad_fn, made when the base's
            # graph was the run's own, is made again from the base's once its version moves.
            torch.autograd.graph.increment_version(base)
        for v in views:
            # Made again now, not at the view's next use: until then the old grad_fn holds the run's
            # graph, and what that graph saved (a view of an input: ``w.unbind(0)[0]``) would look
            # kept outside the call to settle_escapes. (Views an operator returned together, whose
            # grad_fn torch refuses to remake, are outputs of their own: see _kept_as_outputs. Any
            # other view torch refuses keeps the old graph.)
            try:
                v.grad_fn  # noqa: B018
            except RuntimeError:
                pass

    def settle_escapes(self, refs: Sequence[weakref.ref[torch.Tensor]]) -> None:
        """After the call: which of its escaped outputs (weakly, ``refs``) are still held outside.

        The forward run returned every tensor alive at its end, some only because a kept
        tensor's graph saved them; that graph is gone once autograd pointed the kept tensors
        at the Function's node. The dead ones get no cotangent and are not looked for in a
        recomputation, nor digested; the live ones are digested now, with their values as
        the caller got them, and raise where they cannot be right (:meth:`_doubt`).
        """
        live = [r() is not None for r in refs]
        if any(alive and doubt is not None for alive, doubt in zip(live, self.escape_doubts)):
            gc.collect()  # a reference cycle waiting for the collector holds nothing
            live = [r() is not None for r in refs]
        self.escapes_live = live
        for alive, doubt in zip(live, self.escape_doubts):
            if alive and doubt is not None:
                raise CheckpointError(f"remat({self.name}): {doubt}")
        if self._compares_values() and any(live):
            held = [t for t in (r() for r in refs) if t is not None]
            start = len(self.out_digest) - len(refs)
            for j, d in zip([j for j, alive in enumerate(live) if alive], digest(held)):
                self.out_digest[start + j] = d

    def _refuse_stored_inputs(self, flat: tuple[torch.Tensor, ...], given: tuple[torch.Tensor, ...]) -> None:
        """Raise if the forward run stored one of its inputs into an argument or closure.

        ``o.cache = x`` on an argument, ``inputs.append(x)`` on a closure list,
        ``self.last = x`` on a module: the function gets remat's own copy of each input
        (a local leaf), so a gradient through the stored tensor would reach that copy
        and be silently missing. (A tensor the run computed and stored escapes it, and
        becomes an output: see :meth:`_escaped_tensors`.) Checked under plain autograd
        in the non-module arguments, in what the call carries back into the caller's
        containers, in the closure cells, defaults and partial arguments of ``fn``, and in the attributes of the modules it reaches whose class stores
        attributes (:func:`stored_attributes`), breadth first and bounded, not entering
        modules (whose internals hooks and wrappers such as FSDP fill during a call).
        Stores made by hooks or functions outside the modules' classes, and under
        torch.func transforms, are not caught (see the README's limits).
        """
        roots: list[Any] = [o for o in self.objects if not isinstance(o, torch.nn.Module)]
        fn = self.fn
        if isinstance(fn, functools.partial):
            roots += [fn.args, fn.keywords]
            fn = fn.func
        if isinstance(fn, types.FunctionType):
            roots += [*(fn.__closure__ or ()), fn.__defaults__, fn.__kwdefaults__]
        code = getattr(fn, "__func__", fn) if not isinstance(fn, torch.nn.Module) else class_forward(fn)
        if isinstance(code, types.FunctionType):  # (the function's, or the module's forward's)
            # The lists, dicts, sets and deques among the globals its code names (``G.append(x)``), not
            # large ones (walked on every call: a store is small at its first call, which then raises).
            scope = code.__globals__
            roots += [v for v in map(scope.get, global_names(code.__code__)) if type(v) in _STORES and len(cast(Any, v)) <= 256]
        roots += stored_attributes(self.captured)
        if self.container_writes:  # (what goes into the caller's containers: an input inside an object there)
            roots += [content for _, content in self.container_writes]
        roots = [r for r in roots if r is not None]
        if not roots:  # nothing to look into (a plain function of its arguments)
            return
        copies = {id(t) for t, g in zip(flat, given) if t is not g}
        if not copies:
            return
        stored = [t for t in tensors_inside(roots, budget=10_000, into_modules=False) if id(t) in copies]
        if stored:
            raise CheckpointError(
                f"remat({self.name}): the function stored one of its inputs (shape {tuple(stored[0].shape)}) "
                "into an object outside the call (an argument, a closure variable, a global or a module attribute). The function gets "
                "remat's own copy of each input, so a gradient through the stored tensor would reach that "
                "copy and be silently missing. Return it from the function instead, or store a tensor "
                "computed from it (x.clone())."
            )

    def run(self, flat: tuple[torch.Tensor, ...], phase: Phase) -> tuple[torch.Tensor, ...]:
        if phase is Phase.FORWARD:
            return self.forward_run(flat)
        if self._primals_above_a_vmap is not None and not (grad_levels_active() or jvp_levels_active()):
            # The forward run took a grad level of its own above a vmap (``vmap(grad(f))``,
            # ``vmap(jvp(f))``: see _forward_run_at_a_grad_level); a recomputation with none left, for a
            # backward at the base level (``vmap(grad_and_value(f))``'s value, ``vmap(jvp(f))``'s output,
            # then ``.backward()``), takes one too: what the function computes from a module's parameter
            # alone says it requires no grad there, as in the forward run and without remat.
            return at_a_grad_level_of_its_own(lambda full: self.recompute(tuple(full)), flat, self._primals_above_a_vmap)
        return self.recompute(flat)

    def replacements(
        self, captured: Sequence[torch.Tensor]
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """What ``fn`` gets where it reaches each captured tensor (``id`` to tensor): all of them, for
        the modules to reparametrize, and those that are not the captured tensor itself, to substitute.

        A module's own tensors are substituted too, not only put in its places: its code
        may reach them other than through its attributes (a hook's closure, a list or
        partial the module keeps privately), where only the substitution routes them."""
        if not captured:
            return {}, {}
        replace = {id(orig): t for orig, t in zip(self.captured.tensors, captured)}
        return replace, {k: v for k, v in replace.items() if v is not self._originals.get(k)}

    def _running(
        self,
        flat: tuple[torch.Tensor, ...],
        *,
        forward: bool,
        grad: bool,
        modes: Sequence[Any],
        watch: WriteWatch | None = None,
        under: Any = None,
        reached: Sequence[torch.Tensor] = (),
    ) -> _Running:
        """The context ``fn`` runs in, both runs: its inputs and reparametrized modules,
        the user's ``context_fn``, grad mode (``grad``: on, for the forward run's local
        graph), the run's state (captured in the forward run, replayed in a
        recomputation), the substitution of captured tensors, the run's dispatch
        ``modes``, and the debug trace. ``watch``, the forward run's write watch where the
        substitution mode runs it (:meth:`WriteWatch.call`) rather than a dispatch mode.
        ``under``: a torch-function mode entered below the substitution (it sees the tensors
        the substitution passes: a recomputation's :class:`~funckpt._tail.Deferring`).
        ``reached``: the differentiable tensors a recomputation's function reaches and did not at
        the call; it runs under the substitution, which refuses a use of one.

        The dispatch modes are built by the caller before the torch-function mode is
        entered: building them reads the inputs' storages, which must not count as the
        function's use of them.
        """
        return _Running(self, flat, forward, grad, modes, watch, under, reached)

    def forward_run(self, flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The first run, in the forward pass: record what a recomputation must replay and check."""
        plain_autograd = peek_interpreter_stack() is None
        if (
            self.required_grad_at_call is not None
            and (not plain_autograd or self._reads_a_lower_levels_grad(flat, True))
            and not self.vmap_innermost_at_call
            and not self._at_a_grad_level
            and self.saved is None
            and self.caller_grad_enabled  # (not a checkpointed loop's forward sweep, which records nothing)
        ):
            return self._forward_run_at_a_grad_level(flat)
        # The forward run records a local graph (dropped when it ends) when the
        # caller could differentiate, so fn can use autograd inside, as it can
        # under torch.utils.checkpoint. Under torch.func it runs without one.
        # Not where autograd is excluded from dispatch one level below a torch.func level entered
        # under inference_mode: nothing records there, and every output would look constant.
        grad_forward = plain_autograd and self.caller_grad_enabled and not autograd_excluded()
        given = flat
        if grad_forward:
            # An input the caller's level sees as constant may still require grad here, one
            # level lower (``x = xs * 1`` made inside ``torch.func.grad`` from a plain tensor that
            # requires grad): it is an input of this Function's node at this level, so it too
            # becomes a local leaf, and differentiable for the checks on writes.
            self.differentiable = [d or (t.requires_grad and has_gradient_dtype(t)) for t, d in zip(flat, self.differentiable)]
            flat = tuple(
                local_input(t, True) if d and has_gradient_dtype(t) else local_input(t, False) if t.is_inference() else t
                for t, d in zip(flat, self.differentiable)
            )
        # With a policy, the recorder watches input writes too: one dispatch mode, not two.
        # Without one, a watch is needed only for non-differentiable inputs (writes to
        # differentiable ones are caught by their version counters after the run). Outside
        # torch.func transforms the substitution mode runs it, asking each torch function
        # what it writes (WriteWatch.call); under them it is a dispatch mode of its own (the
        # torch functions receive functorch's wrappers, whose storages it cannot see).
        modes: list[Any] = []
        watch = None
        if self.saved is not None:
            modes.append(self.saved.recorder(self._write_watch(flat, plain_autograd, self._local_leaves(flat, grad_forward))))
        elif not all(self.differentiable):
            watch = self._write_watch(flat, plain_autograd, self._local_leaves(flat, grad_forward))
            if not plain_autograd:
                modes.append(watch)
                watch = None
        out: Any = _SUPPRESSED
        # The caller's grad mode, as under torch.utils.checkpoint, also where the run records no
        # graph of its own (below a vmap, in a Function's forward, which turns it off).
        grad_mode = grad_forward or (self.caller_grad_enabled and not plain_autograd)
        at_own_level = self._made_at_own_level is not None  # (see _forward_run_at_a_grad_level)
        # Below a vmap (or jvp) level with no grad level of its own, and in a checkpointed loop's
        # forward sweep (which runs without grad), the run records no graph that would show a
        # tensor it keeps outside the call: what carries a derivative is traced instead. (Through
        # no_grad too where the run itself is under it, or a forward-mode derivative flows.)
        sweep = not self.escapes_become_outputs and not grad_forward
        tainting = (
            any(self.differentiable)
            and not at_own_level
            and (sweep or not (plain_autograd or grad_forward))
            and not _traced()
        )
        # Where the enclosing regions' policies stood before this region's own recorder starts: what
        # they keep of this run carries the graph it records (plain autograd, or below a vmap where a
        # module's parameters require grad), with what its operators saved (see detach_kept_since).
        marks = recording_marks() if grad_forward or tainting else []
        with self._running(flat, forward=True, grad=grad_mode, modes=modes, watch=watch) as run:
            if (grad_forward or at_own_level or tainting) and run.substitute is not None:
                run.substitute.made = []
            if (at_own_level or tainting) and run.substitute is not None:
                run.substitute.nested = []  # (the nodes of the regions nested here: forgotten once fn returns)
            if self.callers_tensors is not None and self.caller_grad_enabled and run.substitute is not None:
                run.substitute.given = self.callers_tensors  # (an input's grad_fn is the caller's: see CallersNodes)
            if (grad_forward or at_own_level) and run.substitute is not None:
                # (A gradient the function takes of its own is checked against the caller's graph.)
                run.substitute.differentiating = (self, given)
            if grad_forward and run.trace is None and run.substitute is not None and not _traced():
                run.substitute.trail = collections.deque(maxlen=_tail.TRAIL_LENGTH)
            if tainting and run.substitute is not None:
                seeds = (t for t, d in zip(flat, self.differentiable) if d)
                run.substitute.taint = Taint(seeds, any_grad_mode=sweep or True not in (self.required_grad_at_call or ()))
            elif at_own_level and forward_mode_active() and run.substitute is not None:
                # The level's graph shows a reverse-mode derivative only: a tangent of an input
                # that does not require grad (vmap(jvp) of a function whose module's parameters
                # do) flows where it does not, and is traced (see _refuse_escapes_of_the_level).
                required = self.required_grad_at_call or [False] * len(flat)
                own_seeds = [t for t, d, r in zip(flat, self.differentiable, required) if d and not r]
                if own_seeds:
                    run.substitute.taint = Taint(own_seeds, any_grad_mode=True)
                del own_seeds
            caller, self.caller_arguments = self.caller_arguments, None
            watched = None if caller is None else self._watch_containers(caller, run.args, run.kwargs)
            out = self._call_fn(run.args, run.kwargs, True, grad_forward)
            if watched:
                assert caller is not None
                self.container_writes = self._container_writes(watched, caller[2], flat)
                # (A copy the function returns is the caller's container, as without remat: ``return lst``.)
                self.returned_container = next((mine for mine, copy, *_ in watched if copy is out), None)
            del caller, watched
        if run.substitute is not None:
            self.followed_hooks = run.substitute.forget_hooks()
            self.callers_nodes, run.substitute.given = run.substitute.callers_nodes, None
            self.own_leaf_hooks = run.substitute.own_leaf_hooks
            if run.substitute.any_hooks:
                self.hooks_in_forward_run = True
        self.callers_tensors = None
        if run.substitute is not None and run.substitute.nested is not None:
            # Where the run records no graph its caller keeps, the nodes of the regions nested in it
            # are never differentiated, but its outputs carry those recorded below its levels (in the
            # enclosing Function's forward) until that Function's node takes them: each holds its
            # region, and the tensors of this run its function closes over (its captured inputs),
            # which would look kept outside the call to the checks for escapes below.
            nested, run.substitute.nested = run.substitute.nested, None
            forget_nested_regions(nested)
            del nested
        if out is _SUPPRESSED:
            raise _suppressed(self.name)
        if run.substitute is not None and run.substitute.layout_draws:
            self.draws_by_layout = True
        made = run.substitute.made if run.substitute is not None else None
        if at_own_level and run.substitute is not None and run.substitute.made is not None:
            self._made_at_own_level, run.substitute.made = run.substitute.made, None
            self._taint_at_own_level, run.substitute.taint = run.substitute.taint, None
        if grad_forward:
            self.moved_hooks = _move_input_hooks(flat, given, self.name, self.of_the_innermost_level)
            _move_retain_grad(flat, given, run.substitute)
            self._carry_data_rebinds(flat, given)
        tensors, slots = flatten(out)
        tensors = _substituted(tensors, run.substitute)
        if grad_forward:
            # Which outputs the run's graph (the caller's, recorded under plain autograd) made
            # differentiable, for the recomputation's to be too (see _autograd.refuse_cut_off).
            self.out_differentiable = [t.requires_grad and not made_under_no_grad(t) for t in tensors]
            # ``h.retain_grad()`` on a tensor fn returns: the caller's output is another tensor
            # (the Function's, or a view rebuilt from it), whose ``.grad`` it must fill instead.
            if any(t.retains_grad for t in tensors):
                self.retained_outputs = tuple(k for k, t in enumerate(tensors) if t.retains_grad)
        self._refuse_hidden_tensors(slots.leaves, plain_autograd)
        # What the run computed and wrote into its copies of the caller's containers, under a transform
        # (and a view of an input under plain autograd): outputs of the Function, at the end (see
        # _outputs_for_written). The containers hold detached aliases of them from here on.
        written = None
        if self.written_copies:  # (where the run wrote into them: see _container_writes)
            if made and run.substitute is not None and not run.substitute.made_nested:
                written = self._written_made(tensors, made, run.substitute.taint or self._taint_at_own_level, flat)
            elif run.substitute is not None and run.substitute.made_nested:
                self.wrote_beside_nested = True  # (for the refusal of what it wrote, under a transform)
            self.written_copies, self.written_before = [], []
        if at_own_level and self.escapes_to_holders and made and run.substitute is not None and not run.substitute.made_nested:
            held = self._held_at_own_level(made, tensors, flat)
            if held:  # (outputs, which their holders get: run_prepared)
                written = [*(written or []), *held]
            del held
        if self.saved is not None:
            self.saved.finish_forward(tuple(tensors))
        if tainting and run.substitute is not None:  # (once the policy holds detached copies of what it keeps)
            taint, run.substitute.taint = run.substitute.taint, None
            assert taint is not None
            run.substitute.made = None
            if self.rewrapped_for_caller:
                # The caller gets each output as another tensor (its grad or jvp level's wrapper):
                # the very tensor returned, kept as well (a forward hook recording a layer's output,
                # as transformers' output_hidden_states does), would carry no derivative. So a
                # detached alias of each is returned, and what the run made is checked as any
                # other tensor kept. (An output viewing an input stays a view of it: a fresh one.)
                tensors = _detached_if_made(tensors, made or [], flat)
                out = None  # (nor does the function's own result hold them on)
            detach_kept_since(marks)
            self._refuse_tainted_escapes(taint, made or [], tensors, flat)
        del made
        substitute = run.substitute
        assert substitute is not None
        if substitute.uninitialized:
            self.values_reproducible = False
        makes_leaves = False  # does fn make tensors that require grad without a graph (a leaf of its own)?
        if grad_forward:
            inside = substitute.inside

            def own(t: torch.Tensor) -> bool:
                nonlocal makes_leaves
                if id(t) not in inside:
                    return False
                makes_leaves = True
                return True

            foreign, reached = local_graph_leaves(tensors, flat, run.first_node, own)
            # Reachable but unused (other layers of a stage the function closes over):
            # neither saved with a version check nor differentiated.
            self.unchecked.update(i for i, t in enumerate(flat) if t.requires_grad and id(t) not in reached)
            if foreign:
                raise CheckpointError(
                    f"remat({self.name}): a differentiable tensor reached the function's result without being "
                    "routed through remat: typically a closure or global tensor passed straight to a custom "
                    "autograd.Function (whose .apply remat cannot intercept) or to TorchScript code (a "
                    "torch.jit.script function or module's method, whose arguments it cannot see). Its gradient "
                    "would be missing. Pass the tensor to the remat'd function as an argument."
                )
            self._refuse_differentiable_writes(flat)
        self.planned = self.views_outside and plain_autograd
        self.plan = _aliasing.plan(flat, tensors, grad_forward) if self.planned else None
        if self.plan is not None:
            self._snapshot_viewed_inputs(flat)
        # Inputs that no gradient flows into but the function read (a mask, frozen
        # weights) keep their version check: a change before the backward would change
        # the recomputation in ways a value digest may not see (a permutation).
        self.used_constants = {
            i for i, t in enumerate(flat) if not t.requires_grad and id(t) in substitute.used and i not in self.snapshots
        }
        if grad_forward:  # what the caller's graph must know (read before copies, made without grad)
            owned = [tensors[i] for i in self.plan.owned] if self.plan is not None else tensors
            if self.plan is not None:  # (and the hidden bases, last)
                owned = owned + [cast(torch.Tensor, tensors[i]._base) for i in self.plan.bases]
            self.constant = {k for k, t in enumerate(owned) if not t.requires_grad}
            del owned  # (a hidden base, with the run's graph: it must not look escaped)
        tensors = _aliasing.owned_outputs(self.plan, tensors)
        # (Before the escapes are looked for: the trail holds what the run made.)
        trail, substitute.trail = substitute.trail, None
        if trail and self.plan is None and not self.rebound_attributes:
            self.tail = _tail.plan(trail, flat, tensors, self._compares_values(), self.saved.keeps if self.saved is not None else None)
        del trail
        if grad_forward:  # drop the run's local graph
            returned_at, viewing = _returned_by_id(tensors)
            tensors = [t.detach() if t.requires_grad else t for t in tensors]
            del out
            escaped = self._escaped_tensors(substitute, flat, marks, returned_at)
            if self.held_escapes:  # (under a transform: outputs, which their holders get: run_prepared)
                written = [*(written or []), *((h.position, h.alias, h.returned) for h in self.held_escapes)]
            self._refuse_stored_inputs(flat, given)
            if escaped:
                escaped = self._kept_as_outputs(escaped, tensors, returned_at)
            if escaped and viewing and self.planned:
                tensors = self._outputs_viewing_kept(tensors, escaped, viewing)
            del returned_at, viewing
            if escaped:  # (as they are: autograd points them at the Function's node)
                self.tail = None  # (a tensor kept outside: the recomputation's must have values)
                self.escaped_at = [k for k, _ in escaped]
                inputs = {id(t) for t in flat}
                self.escape_doubts = [self._doubt(t, inputs) for _, t in escaped]
                self.retains_kept = any(t.retains_grad for _, t in escaped)
                tensors += [t for _, t in escaped]
                del escaped
        if written:
            tensors = self._outputs_for_written(tensors, written)
        del written
        self.out_slots = slots
        self.out_meta = [tensor_meta(t) for t in tensors]
        if self._compares_values():  # (escaped outputs: once the call knows which are held, settle_escapes)
            returned = len(tensors) - len(self.escaped_at)
            self.out_digest = [*digest(tensors[:returned]), *[None] * len(self.escaped_at)]
        self.forward_trace = run.trace.lines if run.trace is not None else None
        # (A hook fn registers on a tensor it makes follows its handle through the mode: see Substitute.hooks.)
        self.substitutes_again = (
            makes_leaves
            or bool(self.followed_hooks)
            or self.callers_nodes is not None
            or self._substitutes_again(substitute, grad_forward)
        )
        if not self.substitutes_again:
            self.forward_substitutes = [weakref.ref(t) for t in substitute.mapping.values()]
        return tuple(tensors)

    def _carry_data_rebinds(self, flat: tuple[torch.Tensor, ...], given: tuple[torch.Tensor, ...]) -> None:
        """Give the caller's tensors the memory that ``.data = ...`` put into their local leaves.

        Under plain autograd the function gets a fresh leaf for each differentiable input
        (:func:`local_input`), which also sits in its module's place while it runs. Setting its
        ``.data`` (weight clipping written ``w.data = w.data.clamp(...)``; ``Module.to``,
        ``.half()`` or ``.float()`` inside a forward, which set each ``param.data``) swaps that
        leaf's memory, not the caller's tensor's: without this the parameter would keep its old
        values, where without remat (and under ``torch.utils.checkpoint``) it holds the new ones.
        The setter moves no version counter: it is found by the leaf's memory having moved, and
        the recomputation starts from the old values (snapshotted, as before an in-place write;
        here, where no write watch ran, from the caller's tensor, which still holds them).

        A setter that changes the shape, dtype or device is refused: the caller's graph was built
        with the input as it was at the call (its ``AccumulateGrad`` expects that dtype), so the
        gradient would reach the parameter in its old dtype.
        """
        moved = [
            i
            for i, (t, g) in enumerate(zip(flat, given))
            # (an inference input's leaf is a copy; a sparse one has no data pointer, nor a .data to set)
            if t is not g and t.layout == torch.strided and _memory_moved(t, g) and not g.is_inference()
        ]
        for i in moved:
            t, g = flat[i], given[i]
            if (t.shape, t.dtype, t.device) != (g.shape, g.dtype, g.device):
                was, now = (g.shape, g.dtype, g.device), (t.shape, t.dtype, t.device)
                raise CheckpointError(
                    f"remat({self.name}): the function set the .data of {self.describe_input(i, g)} to a tensor "
                    f"of another shape, dtype or device ({tuple(was[0])}, {was[1]}, {was[2]} to {tuple(now[0])}, "
                    f"{now[1]}, {now[2]}). Module.to(), .half() or .float() inside a forward do this (the routers "
                    "of HF SwitchTransformers and NLLB-MoE cast their classifier to router_dtype). The caller's "
                    "graph was built with the tensor as it was at the call, so its gradient would arrive in the "
                    "old dtype or shape. Convert the module before calling it (for those routers: "
                    "router.classifier.to(router_dtype) once after loading), so that the conversion inside "
                    "the forward changes nothing."
                )
            if i not in self.snapshots:  # (no write watch ran: every input was differentiable)
                self.snapshots[i] = clone_together([g.detach()])[0]
            self.written_without_grad.add(i)
            g.data = t.detach()

    def _local_leaves(self, flat: tuple[torch.Tensor, ...], grad_forward: bool) -> frozenset[int]:
        """The inputs that are leaves of the graph this forward run records: every differentiable
        one where it records its own (plain autograd), the primals of the grad level of its own
        (see _forward_run_at_a_grad_level), none where it records none."""
        if grad_forward:
            return frozenset(i for i, (t, d) in enumerate(zip(flat, self.differentiable)) if d and has_gradient_dtype(t))
        if self._made_at_own_level is not None:
            required = self.required_grad_at_call or [False] * len(flat)
            return frozenset(i for i, (t, r) in enumerate(zip(flat, required)) if r and has_gradient_dtype(t))
        return frozenset()

    def _reads_a_lower_levels_grad(self, flat: tuple[torch.Tensor, ...], lowered: bool) -> bool:
        """Was the call, made at a grad or jvp level (``grad(f)``, ``vjp``, ``jacrev``, ``jvp``,
        ``jacfwd``, ``vmap(jvp(f))``), given an input requiring grad of a level below it (a module's
        parameter)? Then what the function computes from it alone says it requires no grad without
        remat, and would say it does in the forward run, lowered into plain autograd (a leaf of its
        local graph there) or below a vmap: the forward run takes a grad level of its own (see
        _forward_run_at_a_grad_level), whose primals are the inputs of the innermost level that
        required grad, if any.

        Not where it reaches a TorchScript module, whose parameters would be that level's wrappers (as
        a run's other inputs are: see at_the_top_level): its optimized graph reads their ``.data``,
        which torch refuses there (as ``vmap`` of a scripted module fails without remat), and, its
        primals alone on the level, its profiling executor picked for later runs a graph that records
        no gradient (a zero one). The forward run stays in plain autograd there."""
        required, innermost = self.required_grad_at_call, self.of_the_innermost_level
        # (Asked on every call lowered out of a grad level, as under ``grad`` over a model's parameters,
        # where no input of a lower level requires grad: C loops over lists of bools.)
        if required is None or innermost is None:
            return False
        # Lowered (or below a vmap): any input requiring grad here, where the forward run gets it, other
        # than one that required grad at the innermost level. Also one that said it required none at
        # the call, a tensor of that level computed from (or, in a remat'd call nested in another's run
        # at a level of its own, wrapped from) one requiring grad below it: ``x = xs * 1`` inside
        # ``grad``, a module's parameter reaching a call nested in a run under ``vmap(jvp(f))``.
        lower = (not lowered and True in map(operator.gt, required, innermost)) or (  # (r and not own: a lower level's)
            True in map(_REQUIRES_GRAD, flat)
            and any(t.requires_grad and not (r and own) for t, r, own in zip(flat, required, innermost))
        )
        return (
            lower
            and not any(isinstance(m, torch.jit.ScriptModule) for m, _ in self.captured.modules)
        )

    def _forward_run_at_a_grad_level(self, flat: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The forward run under a grad level of its own, where the call had inputs requiring grad.

        Under plain autograd the forward run records a local graph, and the function sees grad
        mode on and its differentiable inputs requiring grad, as without remat. Under a vmap
        (``vmap(grad(f))``, ``grad(vmap(f))``) or forward-mode level it runs below the caller's grad
        level, in a Function's forward: code that branches on ``torch.is_grad_enabled()`` or
        ``x.requires_grad``, or registers a tensor hook, would compute another thing than without
        remat and than its recomputation (which runs at a grad level). So it runs under a grad
        level of its own (``at_a_grad_level_of_its_own``: a ``torch.func.vjp`` whose vjp function is
        dropped) whose primals are the inputs that required grad at the call. Not with a policy that
        keeps values: what it keeps must be the values of the level the recomputation replays them at.

        Not where the caller's innermost transform is a vmap (``vmap(f)``, ``grad(vmap(f))``,
        ``vmap(f)`` then ``.backward()``): the function without remat sees batched tensors there,
        which say they require no grad, and its recomputation runs below the vmap too, or at a
        vjp of its own above it only as ``vmap(grad(f))``'s does. A grad level on top would change
        what ``torch.autocast`` computes: functorch leaves the autocast dispatch keys alone, and a
        vmap's batching rules dispatch before autocast, a grad level's autograd after it, so under
        a vmap autocast casts what the batching rules make of an operator (a bfloat16 matmul plus
        a float32 bias: a float32 Linear), under a grad level on top the operator itself (a
        bfloat16 ``addmm``). The forward run then returned other dtypes and values than the
        function without remat, and than its recomputation (a false CheckpointError).
        """
        required, innermost = self.required_grad_at_call, self.of_the_innermost_level
        assert required is not None and innermost is not None
        # (Its primals are the inputs of the caller's innermost level that require grad: one of a level
        # below, a module's parameter, joins it as the other inputs do. What the function computes from
        # it alone then says it requires no grad, as without remat, where the recomputation's does.)
        wrt = [i for i, (t, r, own) in enumerate(zip(flat, required, innermost)) if r and own and has_gradient_dtype(t)]
        lowered = peek_interpreter_stack() is None
        if not wrt and not self._reads_a_lower_levels_grad(flat, lowered):
            self._at_a_grad_level = True
            return self.forward_run(flat)

        # (The other inputs join the level too, as torch.func.grad wraps all of its arguments: a
        # vmapped ensemble's BatchNorm statistics, updated in place, or a weight a layer clamps
        # through .data while per-example input gradients are taken: see at_the_top_level.)
        def run(full: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            outs = self.forward_run(tuple(full))
            if lowered:  # (as a run in plain autograd refuses: one of its wrappers stored, of no level once it ends)
                self._refuse_stored_inputs(tuple(full), flat)
            return outs

        self._at_a_grad_level = True
        self._made_at_own_level = []
        if lowered:  # (its recomputations in plain autograd run at a level of their own too)
            self.primals_of_own_level = wrt
        else:
            self._primals_above_a_vmap = wrt
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(self.caller_grad_enabled)  # (a Function's forward runs without)
        try:
            outs = at_a_grad_level_of_its_own(run, flat, wrt)
        finally:
            set_grad_enabled(grad_was)
            made, self._made_at_own_level = self._made_at_own_level, None
            taint, self._taint_at_own_level = self._taint_at_own_level, None
        self._refuse_escapes_of_the_level(made, outs, taint)
        return tuple(outs)

    def _refuse_escapes_of_the_level(self, made: list[weakref.ref[torch.Tensor]], outs: Any, taint: Taint | None = None) -> None:
        """Raise if a tensor the run made at its own grad level outlived it other than as an output
        (a forward hook's list, a module attribute): once the level is gone, what holds it holds a
        tensor of no level, whose gradient would be silently missing (as it raises under grad).
        ``taint``: what carries a forward-mode derivative the level's graph does not show."""

        def alive() -> list[torch.Tensor]:
            returned = {id(o) for o in outs}
            held = held_by_recording_regions() if taint is not None else set()
            return [
                t
                for r in made
                if (t := r()) is not None
                and id(t) not in returned
                and (
                    (t.requires_grad and is_dead_tensor_wrapper(t))
                    or (taint is not None and id(t) not in held and taint.holds(t))
                )
            ]

        escaped = _alive_after_collecting(alive)
        if escaped:
            also_returned = any(unwrap_if_dead(escaped[-1]) is o for o in outs)
            self._refuse_escape_under_transform(escaped[-1], also_returned)

    def _refuse_tainted_escapes(
        self, taint: Taint, made: list[weakref.ref[torch.Tensor]], outputs: Sequence[torch.Tensor], flat: tuple[torch.Tensor, ...]
    ) -> None:
        """Raise if a tensor the run computed from its differentiable inputs outlived it other than as
        an output, where the run records no graph that shows it (see :class:`~funckpt._capture.Taint`).

        Kept, it holds the forward run's values at a level with no derivative: read by a later call
        or by this call's recomputation (a key/value cache the recomputation appends to again, and
        attends over twice: the same values, half the gradient), its derivative is silently missing."""
        returned = [*outputs, *flat]
        escaped = _alive_after_collecting(lambda: taint.escaped(made, returned))
        del returned
        # (What the run made, kept in a list or on an object the function closes over, is no closure
        # rebound to another tensor, for the check before a recomputation; what is kept and carries
        # a derivative raises below.)
        self.made_and_kept = [r for r in made if r() is not None]
        if escaped:  # (what the policies of the regions around this one keep, until they end)
            held = held_by_recording_regions()
            escaped = [t for t in escaped if id(t) not in held]
        if escaped and not forward_mode_active() and any(bottom(t).grad_fn is not None for t in outputs):
            # Asked again once the region's Function is applied (:meth:`refuse_tainted_survivors`): a
            # graph recorded here (below a vmap, where a module's parameters require grad) holds what
            # its operators saved (``w[:, :2]`` for ``h @ w[:, :2]``) under the outputs until the
            # Function's node takes them. (Not where a forward-mode rule runs the function again in
            # between: what that run keeps would take the place of what this one kept.)
            self.tainted_escapes = [weakref.ref(t) for t in escaped]
        elif escaped:
            self._refuse_escape_under_transform(escaped[-1])

    def refuse_tainted_survivors(self) -> None:
        """After the call: raise if a tensor :meth:`_refuse_tainted_escapes` found is still held."""
        refs, self.tainted_escapes = self.tainted_escapes, ()
        alive = _alive_after_collecting(lambda: [t for r in refs if (t := r()) is not None])
        if alive:
            self._refuse_escape_under_transform(alive[-1])

    def _refuse_escape_under_transform(self, t: torch.Tensor, also_returned: bool = False) -> None:
        """Raise for ``t``, computed by the function and kept outside the call under a transform
        (``also_returned``: one the function returned too, under a grad level of the run's own)."""
        explained = self._escape_explained(t)
        if explained is not None:
            raise explained
        if also_returned:
            raise CheckpointError(
                f"remat({self.name}): a tensor of shape {tuple(t.shape)} that the function computed outlived the "
                "call other than as its return value under a torch.func transform: the function returns it and "
                "also keeps it (in a list or dict it appends to, a module attribute). Below a vmap (vmap(grad)) "
                "remat's forward run is at a grad level of its own, where the kept tensor is not the call's "
                "output, and a gradient through it would be silently missing. Keep the remat'd call's output "
                "instead (out = remat(f)(x); kept.append(out)), or detach the kept tensor if it is only kept "
                "for logging."
            )
        raise CheckpointError(
            f"remat({self.name}): a tensor of shape {tuple(t.shape)} that the function computed "
            "outlived the call other than as its return value under a torch.func transform (kept by a "
            "forward hook, a list or dict it appends to, a global, or a module attribute; HF's "
            "output_attentions, output_hidden_states and output_router_logits do this, and its key/value "
            "cache unless the model is called with use_cache=False). remat cannot give "
            "it a graph in the caller's transform, so a gradient through it would be silently missing. "
            "Return it from the function, or detach it if it is only kept for logging (use_cache=False "
            "for a key/value cache)."
        )

    def _escape_explained(self, t: torch.Tensor) -> CheckpointError | None:
        """The refusal of ``t``, computed by the function and kept outside the call under a transform,
        where a write into an argument container is why (one remat does not carry back), if it is."""
        unflattened = _unflattened_container_holding(t)
        if unflattened is not None:
            return _stored_in_unflattened(self.name, t, unflattened)
        recorded = _recorded_by_transformers(t)
        if recorded is not None:
            return CheckpointError(
                f"remat({self.name}): a tensor of shape {tuple(t.shape)} that the function computed was kept "
                f"outside the call by transformers' output recorder (the forward hooks that the installed "
                f"transformers package puts inside the layers for output_{recorded}=True: attention weights, "
                "router logits) under a torch.func transform where remat cannot put the call's output in "
                "its place: forward mode (jvp, jacfwd), vmap(grad) where the recorded tensor is also one the "
                "layer's graph saves (eager attention's weights), or a saving policy below a vmap. A gradient "
                "through it would be silently missing. Under torch.func.grad, vjp and jacrev, and under "
                f".backward(), remat gives it its gradient. Here, call the model without output_{recorded} "
                "(HF computes the load-balancing loss of output_router_logits from those logits), or take "
                "per-example gradients with a loop of torch.func.grad, or use .backward()."
            )
        if self.wrote_beside_nested:
            return CheckpointError(
                f"remat({self.name}): a tensor of shape {tuple(t.shape)} that the function computed outlived "
                "the call other than as its return value under a torch.func transform, and the function wrote "
                "into a list, dict or deque it was passed with a remat'd call or a checkpointed loop "
                "(funckpt.scan, fori_loop, while_loop) nested in it: there remat cannot make a tensor written "
                "into an argument an output of the call, as it does without the nested one (one kept "
                "elsewhere, by a forward hook, a global or a module attribute, is refused as well). Return the tensor "
                "from the function (and write it into the container outside the call), or detach it if it is "
                "only kept for logging."
            )
        return None

    #: A region whose recomputation reaches its captured tensors as the forward run did
    #: (a loop's reversal runs its steps through other paths: it always substitutes).
    recomputes_like_forward = True

    def _substitutes_again(self, substitute: Substitute, grad_forward: bool) -> bool:
        """Must a recomputation run under the substitution mode, or do the modules' places suffice?

        The mode costs a Python call per operator. A recomputation needs it only where
        ``fn`` reaches a captured tensor itself rather than through the module place that
        reparametrization fills (a closure, a global, a hook's closure, a list the module
        keeps). The forward run saw every such use as a swap (``substitute.hit``), provided
        each differentiable captured tensor had a substitute there. Where it had not, and
        where an input is restored from a snapshot, the mode stays. So it does outside a
        forward run that records its local graph: only there are the substitutes fresh
        tensors, whose survival :meth:`recomputation_substitutes` can see. (Nor where fn
        makes leaves of its own, HF T5's position bias: the graph check after a
        recomputation without the mode takes any leaf but its inputs for one it reached.)
        """
        if substitute.hit or not grad_forward or not self.recomputes_like_forward or self._has_fast_path():
            return True
        mapping = substitute.mapping
        for t, i in zip(self.captured.tensors, self.captured_index):
            if i in self.snapshots or (self.differentiable[i] and id(t) not in mapping):
                return True
        return False

    def recomputation_substitutes(self, mapping: dict[int, torch.Tensor], places_by_name: bool, checkable: bool) -> bool:
        """Does this recomputation run under the substitution mode?

        Where a run without it left its inputs (:meth:`_left_its_inputs`), yes: the mode
        routes or refuses what it reached. Otherwise only with captured tensors to
        substitute, and then unless the forward run showed the places suffice, none of
        its substitutes outlived it (the function stored one: a module caching its own
        weight on its first call would read it there; the mode refuses it, as it refuses
        any tensor it cannot route), the places were found as at the call, and the
        result's graph can be checked (``checkable``: :meth:`graph_checkable`).
        """
        if (
            self.recompute_under_mode
            or self.followed_hooks
            or self.callers_nodes is not None
            or any(self._escapes_held())
            or self._has_fast_path()
        ):
            return True
        if not mapping:
            return False
        if self.options.context_fn is not None:  # (its recomputation context is for one run only)
            return True
        return (
            self.substitutes_again
            or places_by_name
            or not checkable
            or any(ref() is not None for ref in self.forward_substitutes)
        )

    def _has_fast_path(self) -> bool:
        """Does the function reach a module with torch's eval-mode fast path (:data:`_FAST_PATH_MODULES`)?

        The forward run, under the substitution mode, never takes it; a recomputation without
        the mode could (a recomputation with nothing to substitute, under torch.func transforms),
        and would then run other operators: values that differ at padded positions, a policy's
        kept values given to the wrong operators, a fused kernel forward-mode AD cannot go through.
        """
        return any(isinstance(m, _FAST_PATH_MODULES) for m, _ in self.captured.training)

    def graph_checkable(self, flat: tuple[torch.Tensor, ...]) -> bool:
        """Can a recomputation's graph be walked back to its inputs: plain autograd, recording, from fresh leaves?"""
        return (
            peek_interpreter_stack() is None
            and forward_ad_level() < 0
            and torch.is_grad_enabled()
            and all(t.grad_fn is None for t in flat if t.requires_grad)
        )

    def _left_its_inputs(self, tensors: list[torch.Tensor], flat: tuple[torch.Tensor, ...], first_node: int) -> bool:
        """Did a recomputation without the substitution mode reach other tensors than the region's?

        Its graph must end at its inputs (the forward run showed fn makes no leaf of its
        own): any other leaf, or graph built before the run, means the function reached a
        tensor another way than in the forward run (a module or attribute rebound since,
        a branch on state, a parameter made on the first call). The recomputation then
        runs again under the mode, which routes such a tensor or refuses it.

        Not asked where the region captured no tensor and its forward run, under plain
        autograd, walked its own graph and found it ends at the region's inputs alone (no
        leaf made inside, which the function may keep and reach again, as a module making a
        parameter on its first call does). Every tensor requiring grad that run used was
        then an argument (the mode and the walk refused any other), so one the
        recomputation reaches another way did not require grad in the forward pass, or was
        not used there: without remat no gradient would flow to it either, and a value it
        changes is the determinism check's to see.
        """
        return local_graph_leaves(tensors, flat, first_node, lambda t: False)[0]

    def _capture_state(self, flat: tuple[torch.Tensor, ...]) -> None:
        """Record the state a recomputation replays: autocast, the generators, the default dtype."""
        self.autocast = _autocast.capture(flat)
        self.default_dtype = torch.get_default_dtype()
        if self.options.preserve_rng_state:
            self.rng = _rng.capture(flat, self.generators)
        if self.captured.training:
            self.backward_hooks = backward_hooks_now(self.captured.training)
        self.global_hooks = global_module_hooks_now()

    def generator_found(self, generator: torch.Generator) -> None:
        """The forward run draws from ``generator``, which the walk at the call did not find (see
        ``Substitute.watch_generators``): from now on it is replayed as one found there, from its
        state now, before that first draw."""
        assert self.rng is not None
        if _rng.add(self.rng, generator):
            self.generators.append(generator)

    def _replay_state(self, autocast: bool = True) -> contextlib.ExitStack[bool | None]:
        """Put back the state the forward run recorded, for the recomputation.

        ``autocast=False`` leaves autocast as it is (a loop's reversal, which runs its steps' vjps
        as well as their recomputations: it replays autocast and the caller's torch-function modes
        around each recomputation only, see ``LoopRegion.run_step_again``). The caller's
        torch-function modes are not among these: a run pushes them back first (see ``_Running``).
        """
        # Built inside a with: a replay that fails to enter (the RNG's) leaves the
        # ones entered before it (autocast's), rather than keeping them on for good.
        with contextlib.ExitStack() as stack:
            for context in self._replays(autocast):
                stack.enter_context(context)
            return stack.pop_all()
        raise AssertionError("unreachable")  # (for type checkers: the with returns)

    def _replays(self, autocast: bool = True) -> list[Any]:
        """The contexts that put back the state the forward run recorded, to enter in order
        (:meth:`_replay_state` enters them; a recomputation's :class:`_Running`, each itself)."""
        contexts: list[Any] = []
        if autocast and (self.autocast is not _autocast.OFF or _autocast.any_enabled()):
            contexts.append(_autocast.replay(self.autocast))
        if self.options.preserve_rng_state and self.rng is not None:
            contexts.append(_rng.replay(self.rng))
            if graph_traced():  # (a replay no graph records: see TracedDraws)
                contexts.append(TracedDraws(self.name))
        if self.captured.training:
            contexts.append(training_as_at_the_call(self.captured.training, self.backward_hooks))
        if self.rebound_attributes:
            contexts.append(attributes_as_at_the_call(self.rebound_attributes))
        if self.global_hooks is not None or global_module_hooks_registered():
            contexts.append(global_module_hooks_as_at_the_call(self.global_hooks))
        if self.default_dtype is not None and self.default_dtype is not torch.get_default_dtype():
            contexts.append(default_dtype_as_at_the_call(self.default_dtype))
        return contexts

    def recompute(self, given: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A later run (backward, jvp, double backward): the forward run again, checked against it."""
        reached = self.reached_since_the_call()
        flat = given
        if self.snapshots:
            # Recompute from the values the forward run started from, on copies
            # that alias each other as the inputs did.
            # (Copies of plain tensors, made as such under whatever transforms are active.)
            with DisableFuncTorch() if self.unbatched_snapshots else contextlib.nullcontext():
                copies = dict(zip(self.snapshots, clone_together(list(self.snapshots.values()))))
            for i in self.unbatched_snapshots:
                copies[i] = _rebatched(self.name, flat[i], copies[i])
            flat = tuple(_restored(t, copies[i]) if i in copies else t for i, t in enumerate(flat))
        modes: list[Any] = []
        replayer = None
        if self.saved is not None and not forward_mode_active():
            replayer = self.saved.replayer()
            modes.append(replayer)
        deferring = None
        if self.tail is not None and peek_interpreter_stack() is None and forward_ad_level() < 0:
            skip = replayer.skip_kernels if replayer is not None else None
            strayed = replayer.stop_replaying if replayer is not None else None
            deferring = _tail.Deferring(self.tail, _METADATA, substitution_depth, nested_run, skip, strayed)
        frontier = None
        hooks_before = {i: _hook_keys(flat[i]) for i in self.moved_hooks}
        unsubstituted = False
        failed: Exception | None = None
        out: Any = _SUPPRESSED
        try:
            with self._running(flat, forward=False, grad=False, modes=modes, under=deferring, reached=reached) as run:
                unsubstituted = run.unsubstituted
                if any(self._escapes_held()):
                    assert run.substitute is not None
                    run.substitute.keep = {k: None for k, held in zip(self.escaped_at, self._escapes_held()) if held}
                if self.written_without_grad:
                    # Those inputs start from their snapshots, as ``t + (snapshot - t).detach()``: not
                    # leaves, as their stand-ins were in the forward run. ``Module.to`` reads each
                    # parameter's ``.grad``, which for a non-leaf warns (ours, not the user's).
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
                        out = self._call_fn(run.args, run.kwargs, False, False)
                else:
                    out = self._call_fn(run.args, run.kwargs, False, False)
                if deferring is not None:
                    frontier = deferring.finish(flat)
        except Exception as e:
            # Without the mode, a tensor reached another way than in the forward run (a module
            # rebound to one of another shape) fails inside fn: under it, the mode names it.
            if not unsubstituted or isinstance(e, torch.OutOfMemoryError):
                raise
            failed = e
        # Hooks fn registers on its inputs were moved to the caller's tensors by the forward
        # run; registered again here, they would apply a second time to this part.
        for i, before in hooks_before.items():
            _remove_hooks_since(flat[i], before)
        if failed is None:
            if out is _SUPPRESSED:
                raise _suppressed(self.name)
            tensors, slots = flatten(out)
        if failed is not None or (unsubstituted and self._left_its_inputs(tensors, flat, run.first_node)):
            self.recompute_under_mode = True
            again = self.recompute(given)
            if failed is not None:
                # Under the mode it ran: what it raised came from the function itself (a flaky
                # call, state that changed), not from a tensor reached another way.
                raise failed
            return again
        if reached:
            self._refuse_reached_returned(tensors, reached)
        del reached
        tensors = _aliasing.owned_outputs(self.plan, _substituted(tensors, run.substitute))
        if self.escaped_at:
            tensors += self._escaped_again(run.substitute)
        if frontier is not None and deferring is not None and not deferring.returns_as_planned(tensors):
            frontier = None  # (the skipped results, computed, are compared as outputs)
        # (Where the tail was skipped, the outputs are uninitialized: the tensors it read are compared.)
        if self.options.determinism_check == "default" and (frontier is not None or not self._reproduced(tensors, slots)):
            try:
                assert self.out_slots is not None
                traces = (self.forward_trace or [], run.trace.lines) if run.trace is not None else None
                if slots.treespec != self.out_slots.treespec:
                    raise CheckpointError(
                        f"remat({self.name}): the recomputation returned a different structure than the "
                        f"forward pass: {slots.treespec} vs {self.out_slots.treespec}. "
                        "Pass determinism_check='none' to skip this check."
                    )
                kept_from = len(self.out_meta) - len(self.escaped_at) if self.escaped_at else None
                check_same_outputs(self.name, self.out_meta, tensors, traces, kept_from)
                if self._compares_values() and frontier is not None:
                    assert self.tail is not None and self.tail.frontier_digest is not None
                    # The outputs no skipped call made (an auxiliary output computed before the tail)
                    # are no function of the frontier: compared as without a tail.
                    returned = self.tail.returns
                    others = [k for k, r in enumerate(returned) if r is None]
                    if others:
                        recomputed: list[Any] = [None] * len(tensors)
                        for k, d in zip(others, digest([tensors[k] for k in others])):
                            recomputed[k] = d
                        forward = [d if r is None else None for d, r in zip(self.out_digest, returned)]
                        check_same_values(self.name, forward, recomputed, traces, kept_from)
                    check_same_values(self.name, self.tail.frontier_digest, digest(frontier), traces, frontier=True)
                elif self._compares_values():
                    check_same_values(self.name, self.out_digest, digest(tensors), traces, kept_from)
            except CheckpointError as e:
                hint = self._requires_grad_hint(given)
                if self.autocast is not _autocast.OFF and transforms_active():
                    hint += AUTOCAST_UNDER_TRANSFORMS_HINT
                if not hint:
                    raise
                raise CheckpointError(str(e) + hint) from None
        return tuple(tensors)

    def _requires_grad_hint(self, given: tuple[torch.Tensor, ...]) -> str:
        """What to add to the determinism check's error where the call has a saving policy and, under
        torch.func transforms, a differentiable input of a level below the call's innermost one (a
        module's parameter under ``torch.func.grad``): its forward run then records a local graph in
        which a tensor computed from that input alone requires grad, where its recomputation, and the
        function without remat, see one that does not (without a policy the forward run takes a grad
        level of its own, which sees it as they do: see :meth:`_forward_run_at_a_grad_level`). A
        function branching on ``requires_grad`` there computes another thing in each run."""
        innermost = self.of_the_innermost_level
        if self.saved is None or self.required_grad_at_call is None or innermost is None:
            return ""
        lower = [i for i, (d, own) in enumerate(zip(self.differentiable, innermost)) if d and not own]
        if not lower:
            return ""
        i = lower[0]
        t = given[i]
        if i in self.captured_index:
            t = self.captured.tensors[self.captured_index.index(i)]
        return (
            f"\nWith a saving policy, under torch.func transforms, this call's forward run sees a tensor computed "
            f"from {self.describe_input(i, t)} alone (a tensor of a level below the transforms') as requiring "
            "grad, where its recomputation and the function without remat see it as requiring none: a function "
            "that branches on requires_grad or grad_fn (`if w.requires_grad:`, a hook registered only where it "
            "holds) computes another thing in each run. If the function does, that is the cause: pass policy=None "
            "(or policies.nothing_saveable), under which the forward run sees it as without remat, or branch "
            "on something else (a flag you pass)."
        )

    def _reproduced(self, tensors: list[torch.Tensor], slots: TreeSlots) -> bool:
        """The determinism check's common case, told at once (see :func:`reproduced`): one output,
        nothing kept outside the call, the same structure. ``False``: the full check decides."""
        if len(tensors) != 1 or self.escaped_at or self.out_slots is None or slots.treespec != self.out_slots.treespec:
            return False
        if not self._compares_values():
            return reproduced(self.out_meta[0], None, tensors[0])
        return len(self.out_digest) == 1 and reproduced(self.out_meta[0], self.out_digest[0], tensors[0])

    def _escapes_held(self) -> list[bool]:
        """Per escaped output: held outside after the call (all of them until it is known)."""
        return self.escapes_live if self.escapes_live is not None else [True] * len(self.escaped_at)

    def _escaped_again(self, substitute: Substitute | None) -> list[torch.Tensor]:
        """The recomputation's tensors at the positions where tensors escaped the forward run
        (a zero stand-in of the same shape for one nobody held: it gets no cotangent)."""
        start = len(self.out_meta) - len(self.escaped_at)
        held = self._escapes_held()
        if not any(held):
            return [_stand_in(*self.out_meta[start + j]) for j in range(len(held))]
        assert substitute is not None and substitute.keep is not None
        kept, substitute.keep = substitute.keep, None
        missing = [k for k in kept if kept[k] is None]
        if missing:
            meta = self.out_meta[start + self.escaped_at.index(missing[0])]
            raise CheckpointError(
                f"remat({self.name}): {the_recomputation()} did not compute again a "
                f"tensor (shape {tuple(meta[0])}) that the forward pass computed and kept outside the call "
                "(a forward hook, a list, a global or a module attribute), whose gradient is asked for: it "
                "ran fewer operators than the forward pass." + KEPT_HINT
            )
        again = [
            t if (t := kept.get(k)) is not None else _stand_in(*self.out_meta[start + j])
            for j, k in enumerate(self.escaped_at)
        ]
        for t in kept.values():  # (the function kept them where it keeps the forward run's: see spent_escape)
            if t is not None:
                setattr(t, SPENT, True)
        return again

    def _snapshot_viewed_inputs(self, flat: tuple[torch.Tensor, ...]) -> None:
        """Copy the inputs the caller gets views of: it may update them in place.

        ``fn`` returning ``x[1:]`` hands the caller a view of ``x``; an in-place
        update through it (allowed without remat) must not change what the
        recomputation starts from. The copy replaces the version-counter check.
        """
        assert self.plan is not None
        viewed = sorted({v.source for v in self.plan.views if v is not None and v.of_input})
        fresh = [j for j in viewed if j not in self.snapshots]
        self.snapshots.update(zip(fresh, clone_together([flat[j].detach() for j in fresh])))
        self.unchecked.update(fresh)

    def _compares_values(self) -> bool:
        """Compare output values too? Not when random operators are allowed to draw anew,
        nor when the forward run read memory it allocated uninitialized."""
        return self.options.determinism_check == "default" and self.options.preserve_rng_state and self.values_reproducible


class WrappedModuleRegion(UserRegion):
    """The module a ``remat(module)`` wrapper wraps, called with its own hooks but not the global ones.

    torch runs the global hooks (``register_module_forward_hook``, ...) on the wrapper's own
    call, which stands for the module's (it poses as the module's class and sits where the
    module sat): run on the module's call again, a hook would apply twice to one layer (a
    hook scaling a ``Linear``'s output would scale it twice, silently).
    """

    def run_fn(self, *args: Any, **kwargs: Any) -> Any:
        return call_with_own_hooks(self.fn, args, kwargs)


class _ForwardRegion(UserRegion):
    """The module a ``remat`` wrapper wraps, its ``forward`` alone: its own hooks run around the
    call (see :func:`_with_own_hooks_around`)."""

    forward: Callable[..., Any]

    def run_fn(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)



def _differentiated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The tensors a gradient of the function's own is taken with respect to (``func``, one of
    ``torch.autograd.grad``, ``torch.autograd.backward``, ``Tensor.backward``, with its arguments);
    ``None`` for a backward pass that names none (every leaf its outputs reach)."""
    # (positionally: grad(outputs, inputs, ...), backward(tensors, grad_tensors, retain_graph,
    # create_graph, grad_variables, inputs), Tensor.backward(self, gradient, retain_graph, create_graph, inputs))
    at = 1 if func is torch.autograd.grad else 5 if func is torch.autograd.backward else 4
    inputs = args[at] if len(args) > at else kwargs.get("inputs")
    if inputs is None:
        return None
    return [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)


def _differentiated_outputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors whose gradient the function takes (see :func:`_differentiated`)."""
    outputs = args[0] if args else kwargs.get("outputs" if func is torch.autograd.grad else "tensors")
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs or ())


def _differentiation_name(func: Any) -> str:
    return "torch.autograd.grad" if func is torch.autograd.grad else ".backward()"


def _leaves_reached(roots: Iterable[Any]) -> set[int]:
    """The ids of the leaves whose AccumulateGrad nodes are reachable from ``roots`` (``None`` skipped)."""
    seen: set[Any] = set()
    leaves: set[int] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node) is AccumulateGrad:
            leaves.add(id(node.variable))
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return leaves


def _reaches(root: Any, t: torch.Tensor) -> bool:
    """Does the caller's graph from ``root`` reach ``t`` (its node and output number, or its
    AccumulateGrad where it is a leaf)? Nodes made before ``t``'s are not followed (a path to it runs
    through nodes made after it, each made after those it leads to), so the walk stays within the
    graph between them, not the whole caller's graph before it. (An AccumulateGrad's number says
    nothing of that: the largest there is, it is always followed, to no node further.)"""
    grad_fn = t.grad_fn
    goal = None if grad_fn is None else (grad_fn, t.output_nr)
    floor = -1 if grad_fn is None else grad_fn._sequence_nr()
    seen: set[Any] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for n, nr in node.next_functions:
            if n is None or n in seen:
                continue
            if goal is None:
                if type(n) is AccumulateGrad and n.variable is t:
                    return True
            elif n is goal[0] and nr == goal[1]:
                return True
            if floor < 0 or n._sequence_nr() >= floor:
                stack.append(n)
    return False
