"""Tensors a function reaches without receiving them: find them, route them, guard.

``remat(fn)`` must give gradients to every differentiable tensor ``fn`` uses,
including the ones it does not receive as arguments: the parameters of an
``nn.Module`` (``fn`` a module or a bound method of one), the arguments bound by
``functools.partial``, the cells of a closure, default argument values, and the
module-level globals its code names (and what it reads off the user's own Python
modules: ``params.W``). Left alone, those tensors would be
constants to the checkpointed region, and their gradients would silently be
zero (under ``torch.func``) or missing (under ``.backward()``).

So, at every call:

1. :func:`find_captured` walks ``fn`` and collects the tensors it can reach;
   they become extra inputs of the region, next to the arguments. For each
   module it also records which tensor sits under which name *now*.
2. While ``fn`` runs (forward pass or recomputation), every module found is
   re-parametrized to the region's own inputs under those names, the way
   ``torch.func.functional_call`` does it. This matters because the
   recomputation happens later, when the module may hold other tensors (after
   ``functional_call`` has restored its parameters, say).
3. :class:`Substitute` (a ``TorchFunctionMode``) replaces every other captured
   tensor, by identity, with the region's input (unwrapped by functorch,
   detached for recomputation, batched by vmap ...), however ``fn`` reaches it:
   cell, global, partial argument or container.
4. During the forward run the same mode watches for *foreign* tensors: a plain
   tensor that requires grad, or a functorch tensor of a transform level the
   region is not running under, that was neither an input nor made inside
   ``fn``. Its gradient cannot be routed, so remat raises
   :class:`~funckpt.CheckpointError` telling the user to pass it as an
   argument. Recomputations run the guard too when there is something to
   substitute; otherwise :func:`changed_captures` checks, once per
   recomputation instead of once per operator, that ``fn`` still reaches the
   tensors it reached at the call. Where it reaches others (a closure variable
   rebound; a list the caller appended the call's output to), or reaches a
   tensor or module where another one sat at the call (a list reordered: where
   the call found tensors other than modules' or modules in a container, it
   records where each sat), the recomputation runs under the mode, which
   refuses a use of one: reached is not read.
5. A remat'd call nested in another's run takes as inputs only the tensors that
   run can route (:func:`refused_around`): what else it reaches is left where it
   is, and refused only if used.
"""

from __future__ import annotations

import collections
import contextlib
import dis
import functools
import operator
import os
import site
import sys
import sysconfig
import threading
import types
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._library.fake_class_registry import FakeScriptObject as _FakeScriptObject
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ._draws import LAYOUT_DRAWS, in_a_run, layout_draw, redrawn
from ._errors import CheckpointError
from ._naming import OnThreadStack
from ._saving import WriteWatch, may_write
from ._tail import TAIL
from ._internals import (
    global_forward_hooks,
    AccumulateGrad,
    StorageWeakRef,
    TransformType,
    VmapInterpreter,
    bottom,
    class_forward,
    custom_function_call,
    forward_ad_level,
    fsdp2_training_state,
    has_gradient_dtype,
    interpreter_stack,
    is_batchedtensor,
    is_dead_tensor_wrapper,
    is_functorch_wrapped,
    maybe_get_level,
    register_node_hook,
    route_node_hooks,
    sequence_nr,
    set_fwd_grad_enabled,
    storage_expired,
    storage_of,
    storage_weak_ref,
    torch_function_modes,
    unpack_dual,
    unwrap_batched,
    unwrap_one_level,
)

# Code from these packages is library code: we do not walk its globals.
_LIBRARY_ROOTS = frozenset(
    {"torch", "funckpt", "optree", "numpy", "functools", "builtins", "typing", "collections", "abc"}
)
_MAX_DEPTH = 6
_MAX_ITEMS = 10_000
_MAX_CONTAINER = 1_000


#: Standard-library modules whose objects are services, not data (loggers, threads, files,
#: sockets, importers, parsers): none holds a tensor a function computes with, and some reach
#: far (a module's ``logger`` holds the logging manager, and through it every logger of the
#: process: hundreds of objects on each call of a Hugging Face layer).
_STDLIB_SERVICES = frozenset(
    {"logging", "threading", "_thread", "multiprocessing", "concurrent", "asyncio", "queue", "socket", "ssl",
     "selectors", "subprocess", "io", "_io", "tempfile", "sqlite3", "importlib", "inspect", "ast", "dis",
     "tokenize", "warnings", "unittest", "pdb", "bdb", "typing", "zipfile", "tarfile", "http", "urllib", "email",
     "xml", "json", "pickle"}
)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _stdlib_service(module: str) -> bool:
    """Is ``module``, where a class is defined, one of :data:`_STDLIB_SERVICES` (a logger's, a lock's, a file's)?

    Instances of such classes are not walked for tensors. A tensor that is reached only through
    such an object is not routed; if it requires grad, the substitution mode refuses it
    as foreign (an error, never a missing gradient). Other standard-library objects are
    walked as any object is (a ``functools.lru_cache`` wrapper, a ``SimpleNamespace``).
    """
    return module.split(".")[0] in _STDLIB_SERVICES


#: Types of the attributes a walk meets most (a module's flags, hook dicts, sizes, names):
#: never a tensor or a generator.
_PLAIN_TYPES = frozenset({bool, int, float, str, dict, list, tuple, set, type(None), collections.OrderedDict})


_GENERATOR = torch.Generator


def is_generator(obj: object) -> bool:
    """``isinstance(obj, torch.Generator)``, answered without it for the common types.

    ``torch.Generator``'s metaclass implements ``isinstance`` in Python on recent
    torch (several times the cost of a type test); the capture walk asks it of
    every attribute of every module on each call.
    """
    kind: Any = type(obj)  # (Any: mypy takes a type[object] for unhashable, _reports_a_class's cache key)
    if kind is torch.Generator:
        return True
    if kind in _PLAIN_TYPES:
        return False
    # By the class, as the metaclass's isinstance asks (not by __class__, which it reads too, and
    # which an HF config, most often the one attribute of a module here not plain, answers in
    # Python), and of the object a FakeScriptObject stands for.
    if issubclass(kind, _FakeScriptObject):
        return is_generator(getattr(obj, "real_obj", None))
    if issubclass(kind, torch.Generator):
        return True
    # A proxy whose class defines __class__ to report the class of what it wraps (wrapt's
    # ObjectProxy, lazy_object_proxy's Proxy): isinstance says it is one, and the draws the
    # function makes through it are replayed as a generator's (its state is read through it).
    return _reports_a_class(kind) and isinstance(obj, torch.Generator)


@functools.lru_cache(maxsize=1024)
def _reports_a_class(kind: type) -> bool:
    """Does ``kind`` define ``__class__`` itself (a proxy's, a ``Mock`` with a spec), so that
    ``isinstance`` may answer for another class than ``kind``?"""
    return any("__class__" in vars(k) for k in kind.__mro__ if k is not object)


@dataclass
class Captured:
    """What :func:`find_captured` found: tensors, and the modules holding some of them."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    generators: list[torch.Generator] = field(default_factory=list)
    # (module, {dotted name: tensor}) as the module was at the call
    modules: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = field(default_factory=list)
    # (module or submodule, its training flag) at the call, for the recomputation to replay
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    # For each module in ``modules``: (owning submodule, attribute name, tensor) per named
    # tensor, in the same order, so reparametrizing needs no dotted-name lookups.
    places: list[list[tuple[torch.nn.Module, str, torch.Tensor]]] = field(default_factory=list)
    # (module, child's name, child) for every submodule of those modules at the call: where one was
    # replaced since, ``reparametrized`` finds the places by name again, as functional_call would.
    edges: list[tuple[torch.nn.Module, str, Any]] = field(default_factory=list)
    # Where the walk found each tensor it reached other than as a module's (its path from ``walked``,
    # see :func:`_tensor_places`), for a recomputation to tell a container reordered or a closure
    # rebound since (see :func:`changed_captures`). ``None`` where the call reaches none such.
    at_places: dict[tuple[Any, ...], dict[Any, torch.Tensor | torch.nn.Module]] | None = None
    walked: Any = None


def _walk(
    root: Any,
    leaf: Callable[[Any], bool],
    expand: Callable[[Any], Iterable[Any]],
    *,
    budget: int | None = None,
    max_depth: int | None = None,
    depth_first: bool = False,
) -> None:
    """The one object walker: visit everything reachable from ``root`` once.

    ``leaf(item)`` records what the walk is looking for (tensors, generators) and
    says whether to stop there; ``expand(item)`` gives what ``item`` holds. Every
    item popped counts against ``budget`` (numbers and strings too: a large
    container of them must not make every call slow); items deeper than
    ``max_depth`` are recorded but not expanded. Weak proxies are skipped (they keep
    nothing alive, and a dead one raises on any use). The walk holds every object
    it visited, so a temporary's ``id`` cannot be reused while it runs. Depth first
    visits in the order a recursive walk would.
    """
    seen: dict[int, Any] = {}
    # A tuple of roots (what a call reaches: its function and its non-tensor arguments, a while
    # loop's body and condition) puts each at depth 0, as each alone would be.
    roots = list(root) if type(root) is Roots else [root]
    pending: collections.deque[tuple[Any, int]] = collections.deque((r, 0) for r in (roots[::-1] if depth_first else roots))
    while pending:
        if budget is not None:
            budget -= 1
            if budget < 0:
                return
        item, depth = pending.pop() if depth_first else pending.popleft()
        if type(item) in weakref.ProxyTypes or leaf(item):
            continue
        if item is None or id(item) in seen or (max_depth is not None and depth > max_depth):
            continue
        seen[id(item)] = item
        children = [(child, depth + 1) for child in expand(item)]
        pending.extend(reversed(children) if depth_first else children)


def _of_a_level_gone(t: torch.Tensor) -> bool:
    """Is ``t`` a torch.func wrapper whose level has ended (a gradient that a hook logged into a
    global list under an earlier ``vmap`` or ``grad``)? Such a tensor is not routed into a later call:
    nothing can use it (torch refuses it as escaped), and as an input it would fail the call (its
    batch size is another vmap's). Asked only outside every run, where the interpreter stack is the
    caller's own (a run lowers it, and a live tensor of the caller's would look gone).

    Dead (a grad or jvp level's, told by torch), or of no level of its kind on the stack
    (:func:`_foreign_level`: levels are numbered again, and a later transform's can have the
    number), or a vmap's of another batch size than the vmap of its number (an ended vmap's of
    the same size looks live: it is not used)."""
    if not is_functorch_wrapped(t):
        return False
    if is_dead_tensor_wrapper(t) or _foreign_level(t):
        return True
    if not is_batchedtensor(t):
        return False
    level = maybe_get_level(t)
    interpreter = next(i for i in interpreter_stack() if i.level() == level)
    value, dim = unwrap_batched(t, level)
    return dim is None or VmapInterpreter(interpreter).batch_size() != value.shape[dim]


def spent_escape(t: torch.Tensor) -> bool:
    """Did ``t`` escape an earlier remat'd call whose one backward pass has run (an MoE layer's
    ``self.aux_loss`` of the previous step, a list of them kept across steps), or is it the copy
    of such a tensor that a recomputation made and the function kept in its place?

    Such a tensor is not routed: its graph is spent, and a call that made it an input would
    send its backward into that graph (which fails, a step later) and keep every earlier
    step's node alive through it. The function may overwrite it, as without remat; a use of
    it raises (``Substitute._check``), as it would without remat in a backward through it.
    """
    node = t.grad_fn
    if node is None:  # (a parameter, a buffer: the common case, told first)
        return False
    if getattr(t, SPENT, False):  # (a recomputation's copy of one, left where the function put it)
        return True
    return type(node).__name__ == "_RematFunctionBackward" and getattr(node, "region", 0) is None


def freed_value(t: torch.Tensor) -> bool:
    """Is ``t`` a plain tensor whose graph a backward pass has freed: the value a call without remat
    left in an attribute or a container (an MoE layer's ``self.aux_loss`` after a step without
    checkpointing, ``keep["h"] = h``, the old-style ``weight_norm``'s ``weight``)? Routed as an input
    itself, its graph would be visited by the autograd engine in every backward pass through the
    call, even with no gradient for it, and the engine would raise "Trying to backward through the
    graph a second time" where without remat nothing goes through it (see ``_call.prepare``).
    (remat's own kept outputs are told by :func:`spent_escape`.)"""
    node = t.grad_fn
    if node is None or is_functorch_wrapped(t) or type(node).__name__ == "_RematFunctionBackward":
        return False
    return _graph_freed(node)


#: Custom ``autograd.Function`` nodes whose saved tensors tell their release (``_raw_saved_tensors``
#: raises once freed; read without unpacking): torch's reentrant checkpoint, a compiled graph. (Not
#: any Function: one that saved nothing raises there too after its backward, and runs again.)
_FUNCTIONS_THAT_SAVE = frozenset({"CheckpointFunctionBackward", "CompiledFunctionBackward"})


def _graph_freed(node: Any, budget: int = 64) -> bool:
    """Has a backward pass freed the graph ``node`` ends (see :func:`freed_value`)?

    Told by the first node that saved tensors, breadth first from ``node`` (within ``budget``
    nodes): a backward pass frees every node it runs, so a freed graph's first such node is freed
    (a graph built since on top of a freed one, or a side value the backward did not reach on top
    of a freed layer, is taken as alive). A saved tensor is read only where no saved-tensor hook
    packed it (reading one may run the hook: ``torch.utils.checkpoint`` would recompute its
    region); one packed by a hook is told freed by the hook's absence, which the release clears.
    Custom ``autograd.Function`` nodes tell it only where listed in :data:`_FUNCTIONS_THAT_SAVE`.
    """
    seen: set[Any] = set()
    pending = collections.deque([node])
    while pending and budget > 0:
        node = pending.popleft()
        if node in seen:
            continue
        seen.add(node)
        budget -= 1
        if type(node).__name__ in _FUNCTIONS_THAT_SAVE:
            try:
                node._raw_saved_tensors
            except RuntimeError as e:
                return "freed" in str(e)
            return False
        names = _saved_names(type(node))
        for raw, unpacked in names:
            try:
                saved = getattr(node, raw)
                if any(r.unpack_hook is not None for r in (saved if isinstance(saved, (list, tuple)) else (saved,))):
                    return False  # (alive, its hooks in place)
                getattr(node, unpacked)
            except RuntimeError as e:
                if "freed" in str(e):
                    return True
        if names:
            return False
        pending.extend(n for n, _ in node.next_functions if n is not None)
    return False


def _saved_names(kind: type) -> tuple[tuple[str, str], ...]:
    """(raw attribute, unpacking attribute) of each tensor an autograd node of type ``kind`` saves."""
    names = _SAVED_NAMES.get(kind)
    if names is None:
        names = _SAVED_NAMES[kind] = tuple(
            (raw, raw[len("_raw") :]) for raw in vars(kind) if raw.startswith("_raw_saved_") and raw[len("_raw") :] in vars(kind)
        )
    return names


_SAVED_NAMES: dict[type, tuple[tuple[str, str], ...]] = {}


#: Set on the tensors a recomputation makes where the forward run made escaped ones: the function
#: keeps them too (in its list, its attribute), with the recomputation's graph, spent by the backward.
SPENT = "_funckpt_spent"
#: Set on the output of the caller's level that a remat'd call put, under a torch.func transform,
#: where its function had left a tensor it computed (a list, a dict: ``UserRegion._swap_held_for_aliases``).
PUT_BACK = "_funckpt_put_back"


class Roots(tuple):  # type: ignore[type-arg]
    """Several objects a call reaches, walked each from depth 0 (see :func:`find_captured`)."""


def find_captured(fn: Callable[..., Any] | Roots, modules_too: bool = True, record_places: bool = False) -> Captured:
    """Tensors reachable from ``fn`` other than through its call arguments.

    Walks modules (parameters, buffers, plain tensor attributes, and what they keep outside
    their registries: :func:`_kept_outside_the_registries`), bound
    methods, ``functools.partial`` objects, closure cells, defaults, the globals
    named by the function's code (recursively into the user's own functions), what
    the code reads off the user's Python modules (:func:`module_reads`), containers,
    and plain objects' ``__dict__``, to a bounded depth. Returns
    each tensor once, in discovery order, each ``torch.Generator`` found, and
    each module with its named tensors. ``modules_too=False`` leaves out what
    modules hold (their forward's code is still walked): the tensors reached
    directly only. ``record_places``: where it finds tensors other than a module's, record where each
    sits (:attr:`Captured.at_places`), for :func:`changed_captures`.
    """
    if type(fn) is types.FunctionType and _reaches_nothing(fn):
        return _NOTHING  # what the walk below finds for such a function, without its set-up
    if not modules_too and isinstance(fn, torch.nn.Module):
        forward = class_forward(fn)
        if type(forward) is types.FunctionType and _reaches_nothing(forward):
            return _NOTHING  # the walk would look at the forward's code only, and find nothing
    if modules_too and isinstance(fn, torch.nn.Module):
        forward = class_forward(fn)
        if type(forward) is types.FunctionType and _reaches_nothing(forward) and not (state := _module_state(fn)).outside:
            # The walk would read the module's state and stop (a GPT block, a decoder layer).
            return Captured(
                list({id(t): t for t in state.named.values()}.values()),
                list({id(g): g for g in state.generators}.values()),
                [(fn, state.named)],
                state.training,
                [state.places],
                state.edges,
            )
    found: dict[int, torch.Tensor] = {}
    generators: dict[int, torch.Generator] = {}
    modules: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    training: list[tuple[torch.nn.Module, bool]] = []
    places: list[list[tuple[torch.nn.Module, str, torch.Tensor]]] = []
    edges: list[tuple[torch.nn.Module, str, Any]] = []
    direct: list[Any] = []  # (one tensor reached other than as a module's, or one module in a container, is enough)
    kept_outside: dict[int, list[tuple[str, Any]]] = {}  # (by module: for _tensor_places, without walking each again)
    # (Outside every run the interpreter stack is the caller's: a wrapper of a level not on it is stale.)
    outside_runs = not _active.internal and not _active.substitutes

    def leaf(obj: Any) -> bool:
        if isinstance(obj, torch.Tensor):
            if not spent_escape(obj) and not (outside_runs and _of_a_level_gone(obj)):
                found.setdefault(id(obj), obj)
                if not direct:
                    direct.append(obj)
            return True
        if is_generator(obj):
            generators.setdefault(id(obj), obj)
            return True
        return isinstance(obj, (str, bytes, int, float))

    def expand(obj: Any) -> list[Any]:
        if isinstance(obj, torch.nn.Module):
            if not modules_too:
                return [class_forward(obj)]
            state = _module_state(obj)
            modules.append((obj, state.named))
            places.append(state.places)
            edges.extend(state.edges)
            for t in state.named.values():
                found.setdefault(id(t), t)
            training.extend(state.training)
            for g in state.generators:  # generators held as attributes (self.gen) are replayed too
                generators.setdefault(id(g), g)
            kept_outside[id(obj)] = state.outside
            outside = [value for _, value in state.outside]
            if record_places and outside and not direct:
                direct.append(obj)  # (where each sits is recorded, as for a container's)
            forward = class_forward(obj)
            if type(forward) is types.FunctionType and _reaches_nothing(forward):
                return outside  # (what walking it would find, told without the walk: see _reaches_nothing)
            return [forward, *outside]
        if isinstance(obj, functools.partial):
            return [obj.func, *obj.args, *obj.keywords.values()]
        if isinstance(obj, types.MethodType):
            return [obj.__self__, obj.__func__]
        if isinstance(obj, types.FunctionType):
            if _is_library(obj):
                return []
            parts: list[Any] = []
            for cell in obj.__closure__ or ():
                try:
                    parts.append(cell.cell_contents)
                except ValueError:  # empty cell
                    pass
            parts += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
            for name in global_names(obj.__code__):
                if name in obj.__globals__:
                    value = obj.__globals__[name]
                    if not isinstance(value, (types.ModuleType, type)):
                        parts.append(value)
            parts += [value for _, _, value in module_reads(obj)]
            return parts
        if isinstance(obj, (list, tuple, set, frozenset, dict)):
            if len(obj) > _MAX_CONTAINER:
                return []
            held = list(obj.values() if isinstance(obj, dict) else obj)
            if record_places and not direct and type(obj) is not Layers and any(isinstance(v, torch.nn.Module) for v in held):
                direct.append(obj)  # (modules in a container: where each sits is recorded too)
            return held
        if isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
            return []
        if callable(obj) and not hasattr(obj, "__dict__"):
            return []
        if _stdlib_service(getattr(type(obj), "__module__", None) or ""):
            return []
        parts = []
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and len(attrs) <= _MAX_CONTAINER:
            parts += list(attrs.values())
        parts += _slot_values(obj)
        if record_places and not direct and any(isinstance(v, torch.nn.Module) for v in parts):
            direct.append(obj)  # (modules held by a plain object: as in a container)
        if callable(obj) and not isinstance(obj, type):
            parts.append(getattr(type(obj), "__call__", None))
        return parts

    _walk(fn, leaf, expand, budget=_MAX_ITEMS, max_depth=_MAX_DEPTH, depth_first=True)
    captured = Captured(list(found.values()), list(generators.values()), modules, training, places, edges)
    if record_places and direct:  # (a closure, partial or global holding tensors, a list of modules: not the common case)
        captured.at_places, captured.walked = _tensor_places(fn, kept_outside), fn
    return captured


class Layers(list):  # type: ignore[type-arg]
    """A segment's layers (``remat(nn.Sequential)``, ``checkpoint_sequential``): funckpt's own list,
    made for one call and held by nothing else. No one reorders it between the forward pass and the
    recomputation, so where each module sits in it is not recorded (:func:`changed_captures`):
    recording it cost about 7 us per layer per call."""


_NOTHING = Captured()  # shared: nothing changes a Captured once found
_NONE_REACHED: dict[int, torch.Tensor] = {}  # (shared, never written: see Substitute.reached_since_the_call)


def _tensor_places(
    root: Any, kept_outside: dict[int, list[tuple[str, Any]]] | None = None
) -> dict[tuple[Any, ...], dict[Any, torch.Tensor | torch.nn.Module]]:
    """The tensors :func:`find_captured` reaches from ``root`` other than as a module's, by where they
    sit: for each object holding some (a function, a container, a partial, an object), its path from
    ``root`` to the tensors it holds by key (a closure variable's or global's name, an index, a dict
    key, an attribute), as the walk first reaches it, to the same depth and size bounds.

    A path names a place, not an object: a list rebuilt in another order, or reordered in place,
    holds other tensors at the same paths; a dict rebuilt with the same keys, in whatever order,
    the same ones. (A set's elements sit nowhere in particular: not recorded.) The modules it holds
    are recorded as the tensors (whose own places their reparametrization keeps).
    """
    found: dict[tuple[Any, ...], dict[Any, torch.Tensor | torch.nn.Module]] = {}
    pending: list[tuple[tuple[Any, ...], Any, int]]
    if type(root) is Roots:
        pending = [((k,), r, 0) for k, r in reversed(list(enumerate(root)))]
    else:
        pending = [((0,), root, 0)]
    seen: dict[int, Any] = {}  # (what the walk visited, alive while it runs: an id is not reused)
    budget = _MAX_ITEMS
    while pending:
        budget -= 1
        if budget < 0:
            break
        path, item, depth = pending.pop()
        if id(item) in seen or depth > _MAX_DEPTH:
            continue
        seen[id(item)] = item
        parts = _keyed_parts(item, kept_outside)
        held: dict[Any, torch.Tensor | torch.nn.Module] | None = None
        for key, part in reversed(parts.items()):
            if isinstance(part, torch.Tensor):
                if not spent_escape(part):
                    if held is None:
                        held = found[path] = {}
                    held[key] = part
                continue
            if isinstance(part, torch.nn.Module):
                if held is None:
                    held = found[path] = {}
                held[key] = part
            if not (part is None or isinstance(part, _NOT_ENTERED) or type(part) in weakref.ProxyTypes or is_generator(part)):
                pending.append((path + (key,), part, depth + 1))
    return found


#: What the walk of :func:`_tensor_places` records or stops at rather than entering.
_NOT_ENTERED = (str, bytes, int, float)


def _keyed_parts(obj: Any, kept_outside: dict[int, list[tuple[str, Any]]] | None = None) -> dict[Any, Any]:
    """What ``find_captured``'s walk (``modules_too=False``) enters from ``obj``, by key; of a module,
    also what it keeps outside its registries (:func:`_kept_outside_the_registries`; ``kept_outside``:
    that of the modules the walk just read, by ``id``, rather than a walk of each module again)."""
    if isinstance(obj, (list, tuple)):
        return {} if len(obj) > _MAX_CONTAINER else dict(enumerate(obj))
    if isinstance(obj, dict):
        if len(obj) > _MAX_CONTAINER:
            return {}
        # (A key that is not plain data stands for itself: a tensor key hashes by identity, and a
        # dict compares equal hashes by identity first.)
        return dict(obj)
    if isinstance(obj, torch.nn.Module):
        # (and what it keeps outside its registries, which the walk enters too: where each sits)
        outside = kept_outside.get(id(obj)) if kept_outside is not None else None
        if outside is None:
            outside = _module_state(obj).outside
        return {_FORWARD: class_forward(obj), **{("attribute", name): value for name, value in outside}}
    if isinstance(obj, types.FunctionType):
        if _is_library(obj):
            return {}
        parts: dict[Any, Any] = {}
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                parts[("variable", name)] = cell.cell_contents
            except ValueError:  # empty cell
                pass
        for k, v in enumerate(obj.__defaults__ or ()):
            parts[("default", k)] = v
        for name, v in (obj.__kwdefaults__ or {}).items():
            parts[("default", name)] = v
        namespace = obj.__globals__
        for name in global_names(obj.__code__):
            value = namespace.get(name, _MISSING)
            if value is not _MISSING and not isinstance(value, (types.ModuleType, type)):
                parts[("global", name)] = value
        for kind, dotted, value in module_reads(obj):
            parts[(kind, dotted)] = value
        return parts
    if isinstance(obj, functools.partial):
        parts = {("argument", k): a for k, a in enumerate(obj.args)}
        parts.update({("keyword", k): v for k, v in obj.keywords.items()})
        parts[_FUNCTION] = obj.func
        return parts
    if isinstance(obj, types.MethodType):
        return {_SELF: obj.__self__, _FUNCTION: obj.__func__}
    if isinstance(obj, (set, frozenset, type, types.ModuleType, types.BuiltinFunctionType)):
        return {}
    if callable(obj) and not hasattr(obj, "__dict__"):
        return {}
    if _stdlib_service(getattr(type(obj), "__module__", None) or ""):
        return {}
    parts = {}
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and len(attrs) <= _MAX_CONTAINER:
        parts.update((("attribute", k), v) for k, v in attrs.items())
    parts.update((("attribute", slot), value) for slot, value in _slot_items(obj))
    if callable(obj) and not isinstance(obj, type):
        parts[_FUNCTION] = getattr(type(obj), "__call__", None)
    return parts


# The keys of what :func:`_keyed_parts` gives that no place is named by (a list's are its indices, a
# dict's its keys: these are tuples, as the keys of a function's variables and of attributes).
_FORWARD, _FUNCTION, _SELF = ("forward",), ("function",), ("self",)


def _place_name(path: tuple[Any, ...], key: Any) -> str:
    """How an error names a place :func:`_tensor_places` found: ``layers[0]``, ``cfg.w``, ``partial argument 1``."""
    name = ""
    for step in (*path[1:], key):
        kind = step[0] if type(step) is tuple and step and isinstance(step[0], str) else None
        if type(step) is tuple and step in (_FORWARD, _FUNCTION):
            continue  # (a module's forward, a method's function, an object's __call__: the same place)
        if type(step) is tuple and step == _SELF:
            name = name or "self"
        elif kind in ("variable", "global") and len(step) == 2:
            name = str(step[1])
        elif kind == "default" and len(step) == 2:
            name = f"the default {step[1]!r}"
        elif kind == "argument" and len(step) == 2:
            name = f"partial argument {step[1]}"
        elif kind == "keyword" and len(step) == 2:
            name = f"partial keyword {step[1]!r}"
        elif kind == "attribute" and len(step) == 2:
            name += f".{step[1]}"
        elif isinstance(step, (str, int, bytes, float, tuple)) or step is None:
            name += f"[{step!r}]"
        else:
            name += "[<object>]"
    return name or "a place"


def _reaches_nothing(fn: types.FunctionType) -> bool:
    """A function whose closure, defaults and globals hold nothing but modules, classes, numbers,
    strings, ``None``, standard-library services (a logger) and functions of which the same is
    true (the wrappers decorators put around a layer's forward, transformers' ``deprecate_kwarg``
    and gradient-checkpointing ones; a helper the function calls); or library code.

    The walk of :func:`find_captured` finds nothing from it; this asks the same
    questions in the same order, so the answer is the same (a global rebound to a
    tensor since the last call is seen: nothing is remembered between calls). At
    anything else, or past :data:`_INERT_FUNCTIONS` functions, it says ``False``
    and the walk decides.
    """
    if _is_library(fn):
        return True
    if not (fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__):
        # The common case (a block's function: globals that are modules and classes), told
        # without the set-up below.
        namespace = fn.__globals__
        chained = _chained_names(fn.__code__)
        for name in global_names(fn.__code__):
            value = namespace.get(name, _MISSING)
            if value is not _MISSING and not isinstance(value, (types.ModuleType, type, str, bytes, int, float)):
                break
            if name in chained and isinstance(value, types.ModuleType) and _is_users_module(value):
                break  # (``params.W``: what the code reads off the user's module decides)
        else:
            return True
    pending, seen = [fn], {id(fn)}
    while pending:
        fn = pending.pop()
        if _is_library(fn):
            continue
        held: list[Any] = []
        for cell in fn.__closure__ or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        held += fn.__defaults__ or ()
        if fn.__kwdefaults__:
            held += fn.__kwdefaults__.values()
        namespace = fn.__globals__
        chained = _chained_names(fn.__code__)
        for name in global_names(fn.__code__):
            value = namespace.get(name, _MISSING)
            if value is not _MISSING and not isinstance(value, (types.ModuleType, type)):
                held.append(value)
            elif name in chained and isinstance(value, types.ModuleType) and _is_users_module(value):
                return False  # (``params.W``: the walk follows what the code reads off the user's module)
        for value in held:
            kind = type(value)
            if kind in _INERT_TYPES:
                continue
            if kind is types.ModuleType:  # (a closure's: the walk follows the reads off the user's)
                if _is_users_module(value):
                    return False
                continue
            if kind is types.FunctionType:
                if id(value) not in seen:
                    if len(seen) == _INERT_FUNCTIONS:
                        return False
                    seen.add(id(value))
                    pending.append(value)
                continue
            # An object of a standard-library service (a logger), which the walk does not enter
            # (unless it is a container too, which it does); anything else, the walk decides.
            if (
                not _stdlib_service(getattr(kind, "__module__", None) or "")
                or isinstance(value, _ENTERED)
                or is_generator(value)  # (one the walk records: a Mock with a generator's spec)
            ):
                return False
    return True


#: What the walk stops at without finding anything (a leaf that is no tensor, or ``None``).
_INERT_TYPES = frozenset({str, bytes, int, float, bool, type(None)})
#: What the walk enters whatever module defines its class.
_ENTERED = (list, tuple, set, frozenset, dict, functools.partial, types.MethodType, torch.Tensor)
#: How many functions :func:`_reaches_nothing` looks into before it leaves the question to the walk.
_INERT_FUNCTIONS = 32


_MISSING = object()


_OPAQUE_DATA = (str, bytes, bytearray, memoryview, int, float, complex, type, types.ModuleType)


def tensors_inside(obj: Any, budget: int | None = None, into_modules: bool = True) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``, a value a function returned.

    Unlike :func:`find_captured` (which looks for what a function *uses*), this
    looks at data: containers, ``__dict__`` and ``__slots__`` attributes (all of a
    module's, private ones included), closure cells and defaults of returned
    functions, bound methods (built-in ones too), partials, the frames of
    generators, and, for objects implemented in C (iterators, ``itertools``,
    ``operator.methodcaller``), the state their pickling protocol exposes. No
    depth or size limit unless a ``budget`` of items is given; breadth first;
    ``into_modules=False`` does not enter ``nn.Module`` objects. A cycle is
    visited once.
    """
    found: dict[int, torch.Tensor] = {}

    def leaf(item: Any) -> bool:
        if isinstance(item, torch.Tensor):
            found.setdefault(id(item), item)
            return True
        return False

    def expand(item: Any) -> list[Any]:
        if isinstance(item, _OPAQUE_DATA) or (not into_modules and isinstance(item, torch.nn.Module)):
            return []
        return _parts(item)

    _walk(obj, leaf, expand, budget=budget)
    return list(found.values())


def _slot_items(obj: Any) -> list[tuple[str, Any]]:
    """``obj``'s ``__slots__`` attributes that are set, by name, along its class hierarchy."""
    items = []
    for klass in type(obj).__mro__:
        slots = getattr(klass, "__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:  # __slots__ = "w" is one slot
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                items.append((slot, getattr(obj, slot)))
    return items


def _slot_values(obj: Any) -> list[Any]:
    """The values of ``obj``'s ``__slots__`` attributes, along its class hierarchy."""
    return [value for _, value in _slot_items(obj)]


def _parts(item: Any) -> list[Any]:
    """What ``item`` holds, for :func:`tensors_inside`."""
    if isinstance(item, dict):
        return list(item.values())
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    if isinstance(item, functools.partial):
        return [item.func, item.args, item.keywords]
    if isinstance(item, types.MethodType):
        return [item.__self__, item.__func__]
    if isinstance(item, types.BuiltinMethodType):  # (x * 2).mul: a method of a tensor
        return [item.__self__]
    if isinstance(item, types.CellType):
        try:
            return [item.cell_contents]
        except ValueError:  # an empty cell
            return []
    if isinstance(item, types.FunctionType):
        return [*(item.__closure__ or ()), item.__defaults__, item.__kwdefaults__]
    if isinstance(item, types.GeneratorType):
        return list(item.gi_frame.f_locals.values()) if item.gi_frame is not None else []
    parts: list[Any] = [*getattr(item, "__dict__", {}).values(), *_slot_values(item)]
    if not hasattr(item, "__dict__") and not type(item).__module__.startswith("numpy"):
        try:  # an object implemented in C: its pickled state names what it holds
            parts.append(item.__reduce_ex__(4))
        except Exception:
            pass
    return parts


class Reached(list):  # type: ignore[type-arg]
    """What :func:`changed_captures` found: the tensors, and for those found at a place that held
    another tensor at the call, the place's name (``where``) and whether the tensor there now was
    reached at the call too, elsewhere (``moved``), by id."""

    where: dict[int, str] = {}  # (shared, never written: replaced where there is something to say)
    moved: frozenset[int] | set[int] = frozenset()
    # The tensors of a module now where another module sat at the call: the recomputation reads
    # them through the module, where its reparametrization put their stand-ins (refused too).
    of_modules: frozenset[int] | set[int] = frozenset()


def changed_captures(fn: Callable[..., Any], before: Captured, made: Iterable[torch.Tensor] = ()) -> Reached:
    """Tensors ``fn`` reaches now that a recomputation must not use in place of the call's.

    Between the forward pass and a recomputation, a closure cell, global or
    partial argument may have been rebound to another tensor; the recomputation
    would silently use it, so it refuses a use of one (see
    :meth:`Substitute.reached_since_the_call`): differentiable leaves (or live functorch tensors)
    reached now and not at the call. Module tensors are left out (they are
    re-parametrized to the call's), and so are results of computations, which
    ``fn`` itself may have stored in a container it closes over: ``made``, those of
    its forward run still alive that are functorch tensors of a level still alive.

    Where the call recorded where it found its tensors (:attr:`Captured.at_places`), also any
    tensor now at a place that held another tensor at the call, where either carries a derivative:
    one the call reached too (a list reordered, an element moved: the recomputation would use it
    where the forward run used the other, each standing in for the other, and with equal values no
    check could tell), or a new one (rebound to a constant, or to a tensor of a transform's level
    that has ended since: the tensor there at the call would silently get no gradient).
    """
    now = find_captured(fn, modules_too=False)
    if not now.tensors and before.at_places is None:
        return Reached()  # (the common case: a function reaching nothing but modules, told at once)
    made_ids = {id(t) for t in made}
    at_the_call = {id(t) for t in before.tensors}
    seen = at_the_call | made_ids
    changed = Reached(
        t
        for t in now.tensors
        if id(t) not in seen
        and (
            (is_functorch_wrapped(t) and not is_dead_tensor_wrapper(t) and _may_carry_a_derivative(t))
            or (t.requires_grad and t.grad_fn is None)
        )
    )
    if before.at_places is not None:
        changed.where, changed.moved, changed.of_modules = {}, set(), set()
        listed = {id(t) for t in changed}
        of_modules: list[torch.Tensor] = []
        for path, held_now in _tensor_places(before.walked).items():
            held_then = before.at_places.get(path)
            if held_then is None:
                continue
            for key, t in held_now.items():
                then = held_then.get(key)
                if then is None or then is t:
                    continue
                if not isinstance(t, torch.Tensor):
                    if isinstance(then, torch.nn.Module):
                        of_modules += _moved_module(changed, before, t, _place_name(path, key))
                    continue
                if not isinstance(then, torch.Tensor) or id(t) in made_ids or id(t) in changed.where:
                    continue
                if id(t) not in at_the_call and (
                    id(t) in listed  # (a differentiable leaf rebound: told as such)
                    or (t.grad_fn is not None and t.requires_grad and not is_functorch_wrapped(t))
                ):
                    continue  # (one with a graph of its own is foreign to the recomputation: refused as such)
                if not (_carries_a_derivative(then) or _carries_a_derivative(t)):
                    continue  # (a constant changed for another: the determinism check sees other values)
                if id(t) in at_the_call:
                    changed.moved.add(id(t))
                changed.where[id(t)] = _place_name(path, key)
                if id(t) not in listed:
                    listed.add(id(t))
                    changed.append(t)
        changed.extend(t for t in of_modules if id(t) not in listed)
    if not changed:  # the common case, told without walking the modules
        return changed
    held = {id(t) for _, named in find_captured(fn).modules for t in named.values()}
    kept = Reached(t for t in changed if id(t) not in held or id(t) in changed.where)
    if changed.where:
        kept.where, kept.moved, kept.of_modules = changed.where, changed.moved, changed.of_modules
    return kept


def _moved_module(changed: Reached, before: Captured, module: Any, place: str) -> list[torch.Tensor]:
    """``module``, reached at the call, is now at ``place``, where another module sat: its tensors, where
    one carries a derivative, are refused (a list of modules reordered: the recomputation would run it
    where the forward run ran the other, and their gradients would go to the wrong parameters)."""
    named = next((named for m, named in before.modules if m is module), None)
    if not named or not any(_carries_a_derivative(t) for t in named.values()):
        return []  # (a module the call did not reach: its tensors are foreign, refused as such)
    moved, of_modules = changed.moved, changed.of_modules
    assert isinstance(moved, set) and isinstance(of_modules, set)  # (set by changed_captures)
    tensors = []
    for t in named.values():
        if id(t) not in changed.where:
            changed.where[id(t)] = place
            moved.add(id(t))
            of_modules.add(id(t))
            tensors.append(t)
    return tensors


def _carries_a_derivative(t: torch.Tensor) -> bool:
    """Could a derivative flow into ``t`` (see :func:`_may_carry_a_derivative`; a dead functorch
    wrapper counts as it reads: its level's flag)?"""
    return t.requires_grad or has_tangent(t) or (is_functorch_wrapped(t) and _may_carry_a_derivative(t))


def _may_carry_a_derivative(t: torch.Tensor) -> bool:
    """Could a live functorch tensor carry a derivative: a floating dtype, and at one of its levels it
    requires grad or carries a tangent? (A BatchedTensor reads False whatever it wraps: each level
    is asked.) An integer tensor, or one detached at every level (a log the code around a call
    appends to, below a vmap), carries none: reached by a recomputation, it is no rebound input."""
    if not has_gradient_dtype(t):
        return False
    while True:
        if t.requires_grad or has_tangent(t):
            return True
        if not is_functorch_wrapped(t):
            return False
        t = unwrap_one_level(t)


@dataclass
class _ModuleState:
    """What :func:`_module_state` reads off a module and its submodules in one pass."""

    named: dict[str, torch.Tensor]  # parameters, buffers, plain tensor attributes, by dotted name
    places: list[tuple[torch.nn.Module, str, torch.Tensor]]  # (owner, attribute, tensor), as ``named``
    training: list[tuple[torch.nn.Module, bool]]  # every submodule once, with its flag
    generators: list[torch.Generator]  # generators held as attributes
    edges: list[tuple[torch.nn.Module, str, Any]]  # (module, child's name, child), each module once
    # (dotted name, value) of what the walk enters besides: see :func:`_kept_outside_the_registries`
    outside: list[tuple[str, Any]] = field(default_factory=list)


def _module_state(module: torch.nn.Module) -> _ModuleState:
    """Parameters, buffers and plain tensor attributes by dotted name (aliases kept, in the order
    ``named_parameters``, then ``named_buffers``, then attributes give them), where each sits,
    the training flags and the generators, in one walk of the submodules (the three walks of
    ``named_parameters``, ``named_buffers`` and ``modules`` cost more than the rest of a call)."""
    # Built in plain loops (a comprehension is a call of its own, per submodule): parameters
    # straight into the result, buffers and attributes after them, in that order.
    named: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
    buffers: list[tuple[str, torch.nn.Module, str, torch.Tensor]] = []
    attrs: list[tuple[str, torch.nn.Module, str, torch.Tensor]] = []
    training: list[tuple[torch.nn.Module, bool]] = []
    generators: list[torch.Generator] = []
    edges: list[tuple[torch.nn.Module, str, Any]] = []
    outside: list[tuple[str, Any]] = []
    visited: set[int] = set()
    sharded = _sharded_types()
    ddp = _ddp_type()
    # ``named_modules(remove_duplicate=False)``'s order (depth first, children in order), without its
    # nested generators and their per-level prefixes: a stack of (dotted prefix, module, whether its
    # children are still to be pushed). A class's own ``named_modules`` answers for its subtree (the
    # remat wrapper's first shares the dictionaries of the module it wraps again: see _modules._resync).
    # (and how deep: a module registered as a submodule of its own submodules would grow the stack
    # without end, where named_modules' recursion stopped at Python's recursion limit)
    pending: list[tuple[str, torch.nn.Module, bool, int]] = [("", module, True, 0)]
    deepest = sys.getrecursionlimit()
    while pending:
        dot, m, expand, depth = pending.pop()
        if sharded and isinstance(m, sharded) and _fsdp_hooks_would_run(m):
            _refuse_sharded(m, dot[:-1])
        if ddp is not None and _prepares_from_outputs(m, ddp):
            _refuse_ddp(m, dot[:-1])
        if not expand:
            pass
        elif type(m).named_modules is not _NAMED_MODULES:
            below = list(m.named_modules(remove_duplicate=False))[1:]  # (the first is m itself)
            pending.extend([(f"{dot}{p}.", c, False, depth) for p, c in reversed(below)])
        elif m._modules:
            if depth == deepest:
                _refuse_cycle(module, dot)
            pending.extend([(f"{dot}{k}.", c, True, depth + 1) for k, c in reversed(m._modules.items()) if c is not None])
        for k, p in m._parameters.items():
            if p is not None:
                name = dot + k
                named[name] = p
                where[name] = (m, k, p)
        if m._buffers:
            for k, b in m._buffers.items():
                if b is not None:
                    buffers.append((dot + k, m, k, b))
        first = id(m) not in visited
        if first:
            visited.add(id(m))
            training.append((m, m.training))
            for k, c in m._modules.items():
                edges.append((m, k, c))
        attributes = vars(m)
        if first and (attributes.get("_forward_hooks") or attributes.get("_forward_pre_hooks") or "forward" in attributes):
            outside.extend(_code_run_on_the_call(m, dot, attributes))  # (hooks, an instance's forward)
        kinds = list(map(type, attributes.values()))
        if _SCREENED.issuperset(kinds) and kinds.count(dict) <= _OWN_DICTS:
            continue  # most modules: nothing but plain values (tuples: a kernel size), no list or dict of their own
        scans, scanned = [(m, attributes)], {id(m)}
        for owner, attributes in scans:
            for key, value in attributes.items():
                kind = type(value)
                if kind in _HOLDS_NOTHING:
                    continue
                if kind in _OUTSIDE_CONTAINERS or issubclass(kind, torch.nn.Module):
                    if not first or key in _MODULE_OWN:
                        continue
                    if issubclass(kind, torch.nn.Module) and value._parameters is m._parameters:
                        # The module a remat wrapper wraps: its registries are the wrapper's, walked
                        # here; what it keeps besides (a plain tensor attribute, an unregistered list
                        # of parameters, a hidden layer) is the wrapper's too, under the same names.
                        # (And the one a wrapper of a wrapper wraps, remat(remat(layer)), each once.)
                        if id(value) not in scanned:
                            scanned.add(id(value))
                            wrapped_attributes = vars(value)
                            scans.append((value, wrapped_attributes))
                            outside.extend(_code_run_on_the_call(value, f"{dot}{key}.", wrapped_attributes))
                        # Listed too, for its training flag and its plain attributes, which are
                        # its own: a remat'd call nested in this one that rebinds a flag on it
                        # (ActNorm's ``self.initialized``) or state (``self.hidden``) must find
                        # them as at this call in this call's recomputation, as the module itself does.
                        if id(value) not in visited:
                            visited.add(id(value))
                            training.append((value, value.training))
                    elif _kept_outside_the_registries(owner, value):
                        outside.append((dot + key, value))
                    continue
                if kind in _PLAIN_TYPES:
                    continue
                # (By its class, not isinstance: that reads __class__ too, which an HF config, the
                # one attribute of most of its modules that is not plain, answers in Python.)
                if issubclass(kind, torch.Tensor):
                    if not key.startswith("_") and not spent_escape(value):
                        attrs.append((dot + key, owner, key, value))
                elif first and is_generator(value):
                    generators.append(value)
    for name, owner, key, t in (*buffers, *attrs):
        named[name] = t
        where[name] = (owner, key, t)
    if outside:
        outside = _not_aliases(outside, named, visited)
    return _ModuleState(named, list(where.values()), training, generators, edges, outside)


def _code_run_on_the_call(owner: torch.nn.Module, dot: str, attributes: dict[str, Any]) -> list[tuple[str, Any]]:
    """A module's forward hooks and pre-hooks, and a ``forward`` set on the instance (a hand-written
    LoRA's ``layer.forward = new_forward``), that reach a differentiable tensor or a trainable module
    the walk of the registries does not find: code the module runs at every call, inside the
    remat'd function, as its closure is.

    A hook adding a trainable steering vector to a layer's output, or applying an adapter kept
    outside the model (closures over ``nn.Parameter`` objects, a dict that ``torch.func.grad``'s
    function fills with its inputs), is as much the function's as its own closure. Left
    unwalked, its tensors were refused as unreachable (a false ``CheckpointError``). Hooks of
    library code (transformers' output recorders, torch's own) and hooks that reach no such
    tensor (a logger, a hook closing over its module's own parameters, which the module's walk
    routes already) add nothing: only what reaches one is entered. A module the hook closes over
    is one such where it is kept outside ``owner``'s registries and has a trainable parameter (an
    intervention module, pyreft's way), not ``owner`` or a module holding it (the hook's own
    layer, a back-reference to the model: see :func:`_kept_outside_the_registries`).
    """
    found: list[tuple[str, Any]] = []
    for kind in ("_forward_pre_hooks", "_forward_hooks"):
        for key, hook in (attributes.get(kind) or {}).items():
            if _reaches_a_differentiable_tensor(hook, owner):
                found.append((f"{dot}{kind}[{key}]", hook))
    forward = attributes.get("forward")
    if forward is not None and _reaches_a_differentiable_tensor(forward, owner):
        found.append((f"{dot}forward", forward))
    return found


def global_module_hooks() -> list[Any]:
    """The global forward hooks and pre-hooks (``torch.nn.modules.module.register_module_forward_hook``)
    that reach a differentiable tensor: every module a remat'd function calls runs them, inside the
    call (see :func:`_code_run_on_the_call`). Told by two reads where none is registered."""
    pre, post = global_forward_hooks()
    if not (pre or post):
        return []
    return [hook for hook in (*pre.values(), *post.values()) if _reaches_a_differentiable_tensor(hook)]


def _reaches_a_differentiable_tensor(code: Any, owner: torch.nn.Module | None = None) -> bool:
    """Does ``code`` (a hook, an instance's ``forward``) reach, other than through a module, a leaf
    tensor that requires grad or belongs to a live torch.func transform (not an activation a logging
    hook keeps, which a call does not take as an input: see :func:`_kept_outside_the_registries`),
    or hold in its closure, defaults or partial arguments (or a global it names) a module outside
    ``owner``'s registries with a trainable parameter? (``owner`` None, a global hook's: tensors only.)"""
    if _installed_code(code) or (type(code) is types.FunctionType and _reaches_nothing(code)):
        return False
    for t in find_captured(code, modules_too=False).tensors:
        if t.grad_fn is None and _differentiable(t):
            return True
    return owner is not None and any(
        isinstance(value, torch.nn.Module)
        and _kept_outside_the_registries(owner, value)
        and any(_differentiable(p) for p in value.parameters())
        for value in _held_directly(code)
    )


def _differentiable(t: torch.Tensor) -> bool:
    """Does ``t`` require grad, carry a forward-mode tangent or belong to a live torch.func transform?"""
    return t.requires_grad or has_tangent(t) or (is_functorch_wrapped(t) and not is_dead_tensor_wrapper(t))


def _held_directly(code: Any) -> list[Any]:
    """What a hook holds itself: its closure's values, defaults and the globals its code names, a
    partial's arguments (and theirs)."""
    held: list[Any] = []
    while isinstance(code, functools.partial):
        held += [*code.args, *code.keywords.values()]
        code = code.func
    if isinstance(code, types.MethodType):
        code = code.__func__
    if type(code) is types.FunctionType:
        for cell in code.__closure__ or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        held += [*(code.__defaults__ or ()), *(code.__kwdefaults__ or {}).values()]
        namespace = code.__globals__
        held += [namespace[name] for name in global_names(code.__code__) if name in namespace]
    return held


def _installed_code(code: Any) -> bool:
    """Is ``code`` (a hook) a function of an installed package, not the user's (transformers' output
    recorders, which it puts on every decoder layer and attention module)? Such hooks keep what
    they record; they reach no tensor of the user's to differentiate, and walking each at every
    call would cost a layer's walk several times over."""
    while isinstance(code, (functools.partial, types.MethodType)):
        code = code.func if isinstance(code, functools.partial) else code.__func__
    return type(code) is types.FunctionType and _installed_module(code.__globals__.get("__name__") or "")


@functools.lru_cache(maxsize=1024)
def _installed_module(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not _is_users_module(module)


def _not_aliases(
    outside: list[tuple[str, Any]], named: dict[str, torch.Tensor], visited: set[int]
) -> list[tuple[str, Any]]:
    """Of what modules keep outside their registries, what the registries do not hold already: not
    a list of the module's own parameters (``nn.LSTM``'s ``_flat_weights``, DDP's
    ``_module_parameters``) nor a module registered elsewhere in the tree, whose tensors the walk
    of the registries finds by name. Entered, they would add nothing but a record of where each
    sits, on every call."""
    registered = {id(t) for t in named.values()}

    def alias(value: Any) -> bool:
        if not isinstance(value, (torch.Tensor, torch.nn.Module, list, dict)):
            return False  # (a hook or a forward: see _code_run_on_the_call)
        if isinstance(value, torch.nn.Module):
            return id(value) in visited
        if isinstance(value, torch.Tensor):
            return id(value) in registered
        items = value.values() if type(value) is dict else value
        return all(alias(v) for v in items if isinstance(v, (torch.Tensor, torch.nn.Module)))

    return [(name, value) for name, value in outside if not alias(value)]


def _refuse_cycle(module: torch.nn.Module, dot: str) -> None:
    start = dot.split(".")[:6]
    raise CheckpointError(
        f"remat: the submodules of {type(module).__name__} nest deeper than Python's recursion limit "
        f"({'.'.join(start)}...): a module registered as a submodule of one of its own submodules (a "
        "reference to a parent assigned as an attribute registers it). Keep such a reference outside "
        "the registries (object.__setattr__(self, 'parent', parent)); torch's own walks of the "
        "submodules (to(), state_dict()) do not end either."
    )


_NAMED_MODULES = torch.nn.Module.named_modules
#: nn.Module's own attributes (its registries, hook dicts and flag), which hold no container of the user's.
_MODULE_OWN = frozenset(vars(torch.nn.Module()))
#: How many of them are plain dicts: a module with more has a dict of its own (told without a loop).
_OWN_DICTS = list(map(type, vars(torch.nn.Module()).values())).count(dict)
#: The plain types of :data:`_PLAIN_TYPES` that the walk does not enter on a module: tuples too, which
#: every convolution and LayerNorm holds (a kernel size, a shape), and which then need no loop.
_HOLDS_NOTHING = frozenset({bool, int, float, str, type(None), set, collections.OrderedDict, tuple})
#: :func:`_module_state`'s screen: a module whose attributes are all of these, with no more dicts than
#: ``nn.Module``'s own, keeps nothing outside its registries (one pass in C; a loop costs ~4 us a conv).
_SCREENED = _HOLDS_NOTHING | {dict}
#: Containers a module may keep parameters or modules in outside its registries.
_OUTSIDE_CONTAINERS = (list, dict)
#: Past this many items a container is not looked into (an attribute of a module is read at every call).
_MAX_OUTSIDE = 64


def _kept_outside_the_registries(owner: torch.nn.Module, value: Any) -> bool:
    """Is ``value``, an attribute of ``owner`` outside ``nn.Module``'s registries, what the walk
    must enter for tensors ``owner``'s code may differentiate: a module kept out of the registries
    (``object.__setattr__(self, "shared", embedding)``, so that it is neither saved nor counted
    twice), or a list or dict of such modules or of leaf tensors that require grad
    (``self.ws = [nn.Parameter(...)]``, unregistered)?

    Without remat their gradients flow as any tensor's; a walk of the registries alone left them
    unreachable, and remat refused them (a false ``CheckpointError``). Not entered: a container
    that also holds a tensor with a graph (activations a hook or the module itself keeps: a
    tensor kept outside the call is no input of the next one) or a functorch wrapper whose
    transform has ended (an input or activation kept from a call under ``vmap`` or ``grad``,
    which any use, a ``detach()`` routing it included, refuses), or a larger one; the module a
    remat wrapper wraps, whose registries are the wrapper's own; and a module that holds
    ``owner`` among its submodules (a back-reference to the model or layer it sits in:
    ``object.__setattr__(self, "root", model)``, ``self.parent = [parent]``), or a container
    of one. That is where ``owner`` sits, not what it keeps: entered, every call of a layer
    would route the whole model's tensors, and refuse its other FSDP-managed layers as called.
    Nor a module managed by FSDP, or a DDP module refused as called, or one holding either (see
    :func:`_holds`).
    """
    kind = type(value)  # (by its class, not isinstance: see _module_state)
    if kind in _OUTSIDE_CONTAINERS:
        if not value or len(value) > _MAX_OUTSIDE:
            return False
        if torch._C._is_torch_function_mode_enabled():
            # (A call nested in another's run: that run's substitution mode answers a tensor's
            # metadata for its stand-in, which may not require grad where the tensor does. Each
            # call of the function must find the same tensors: the tensor's own flags decide.)
            with torch._C.DisableTorchFunction():
                return _kept_outside_the_registries(owner, value)
        items = value.values() if kind is dict else value
        found = False
        for item in items:
            if isinstance(item, torch.Tensor):
                if item.grad_fn is not None or is_dead_tensor_wrapper(item):
                    return False  # (kept from a call: with a graph, or of a transform that has ended)
                found = found or item.requires_grad
            elif isinstance(item, torch.nn.Module):
                if _holds(item, owner):
                    return False
                found = True
        return found
    return (
        issubclass(kind, torch.nn.Module)
        and value._parameters is not owner._parameters  # (a remat wrapper's module: its own state)
        and not _holds(value, owner)
    )


def _holds(module: torch.nn.Module, owner: torch.nn.Module) -> bool:
    """Is ``owner`` ``module`` or one of its submodules (through its registries), or the module a
    remat wrapper among them wraps (whose ``_parameters`` are the wrapper's)? Or is one of them
    managed by FSDP (a teacher or EMA copy, sharded, that the owner keeps a reference to), or a
    DDP module that prepares from its outputs' graph: the walk would refuse it as called inside
    the remat'd function (see :func:`_refuse_sharded`, :func:`_refuse_ddp`), where the owner may
    only keep it. Told by a walk of ``_modules`` (not ``modules()``, which a class
    may override), each module once."""
    own = owner._parameters
    sharded = _sharded_types()
    ddp = _ddp_type()
    pending, seen = [module], {id(module)}
    while pending:
        m = pending.pop()
        if m is owner or getattr(m, "_parameters", None) is own or (sharded and isinstance(m, sharded)):
            return True
        if ddp is not None and _prepares_from_outputs(m, ddp):
            return True  # (a DDP teacher kept by reference: refused as called, see _refuse_ddp)
        for child in getattr(m, "_modules", {}).values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                pending.append(child)
    return False


def _places_by_name(captured: Captured) -> list[list[tuple[torch.nn.Module, str, torch.Tensor]]]:
    """``captured.places`` with each owner looked up again by its dotted name (a submodule was
    replaced since the call). A name that no longer leads to a module holding that entry keeps
    the call's owner: a layer wrapped in place since (an adapter around it, whose ``weight``
    may be a read-only property forwarding to the layer) still has the call's layer inside."""
    found = []
    for (module, named), places in zip(captured.modules, captured.places):
        now = []
        for name, (owner, key, t) in zip(named, places):
            prefix = name.rpartition(".")[0]
            try:
                there = module.get_submodule(prefix) if prefix else module
            except AttributeError:
                there = owner
            if _held(there, key) is not _ABSENT:
                owner = there
            now.append((owner, key, t))
        found.append(now)
    return found


def submodule(parent: torch.nn.Module, name: str) -> Any:
    """``parent._modules.get(name)``, also for a TorchScript module (``torch.jit.script``), whose
    ``_modules`` is a wrapper without ``get``."""
    modules = parent._modules
    return modules[name] if name in modules else None


def _refuse_sharded(m: torch.nn.Module, prefix: str) -> None:
    raise CheckpointError(
        f"remat: {type(m).__name__}{f' (at {prefix!r})' if prefix else ''} is managed by FSDP, "
        "and calling it inside the remat'd function would let FSDP's hooks swap its "
        "parameters during the call, so remat cannot route or recompute them. Checkpoint the "
        "sharded module itself (remat(block)(x), checkpoint(block, x): FSDP2's hooks then run "
        "around the checkpointed forward), or apply remat first and shard the result: "
        "fully_shard(remat(block)); and do not fully_shard the layers inside a remat'd "
        "nn.Sequential (remat each layer and shard that instead)."
    )


def _ddp_type() -> type[torch.nn.parallel.DistributedDataParallel] | None:
    """``DistributedDataParallel``, where a process group is up (else no module can be one)."""
    dist = torch.distributed
    return torch.nn.parallel.DistributedDataParallel if dist.is_available() and dist.is_initialized() else None


def _prepares_from_outputs(m: Any, ddp: type[torch.nn.parallel.DistributedDataParallel]) -> bool:
    """Is ``m`` a DDP module that prepares its reduction from the graph of its outputs?"""
    return issubclass(type(m), ddp) and bool(m.find_unused_parameters or m.static_graph)


def _refuse_ddp(m: torch.nn.Module, prefix: str) -> None:
    """A DDP module reached inside a remat'd function, whose forward prepares the gradient reduction
    from the caller's autograd graph (``find_unused_parameters``, ``static_graph``): the forward
    run records no graph to its parameters, and the recomputation runs DDP's forward again in the
    middle of the backward pass, so the reducer would raise "marked ready twice" or reduce before
    the gradients exist (silently wrong). remat of the DDP module itself runs DDP's forward
    around the checkpointed module instead (see ``_call._ddp_around``)."""
    flags = [f"{k}=True" for k in ("find_unused_parameters", "static_graph") if getattr(m, k, False)]
    raise CheckpointError(
        f"remat: the DistributedDataParallel module{f' at {prefix!r}' if prefix else ''} "
        f"({', '.join(flags)}) is reached inside the remat'd function: DDP prepares its gradient "
        "reduction in its forward from the autograd graph of its outputs, which remat's forward run "
        "does not record and its recomputation runs again in the middle of the backward pass, so the "
        "gradients would be reduced wrongly. Checkpoint the DDP module itself (remat(ddp), or "
        "checkpoint(ddp, x): remat then runs DDP's forward around the checkpointed module), or "
        "remat the layers inside it and wrap the model in DDP (DDP(model) with remat'd layers)."
    )


def is_sharded(module: Any) -> bool:
    """Is ``module`` managed by FSDP (whose hooks swap its parameters around its calls)?"""
    sharded = _sharded_types()
    return bool(sharded) and isinstance(module, sharded)


def is_fsdp2_module(module: Any) -> bool:
    """Is ``module`` managed by FSDP2 (``fully_shard``)? (Not FSDP1's ``FullyShardedDataParallel``.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return kind is not None and isinstance(module, kind)


def _sharded_types() -> tuple[type[Any], ...]:
    """FSDP's module types, if FSDP was imported (else no module can be one)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return ()
    return tuple(t for t in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if t)


def _fsdp_hooks_would_run(module: torch.nn.Module) -> bool:
    """Would calling ``module`` inside remat run FSDP's hooks on it?

    Not while FSDP2 is inside the module's own forward, or gathering it for a
    recomputation in the backward (its state says ``FORWARD`` or ``PRE_BACKWARD``):
    ``remat(self.inner)`` there sees the gathered parameters and is fine, with or
    without tensor parallelism. At any other time it would (even
    with ``reshard_after_forward=False``, where the parameters stay gathered
    between calls). FSDP1 (flat parameters) is always refused, and so is a state
    this code cannot read.
    """
    fsdp = sys.modules["torch.distributed.fsdp"]
    if isinstance(module, getattr(fsdp, "FullyShardedDataParallel", ())):
        return True
    try:
        return fsdp2_training_state(module) not in ("FORWARD", "PRE_BACKWARD")
    except Exception:  # FSDP's internals moved: refuse rather than guess
        return True


# The runs, of every thread, that hold module places now, in the order they entered. Runs in one
# thread leave in the reverse order, and each puts back what it found. Two threads running the same
# module at once (unsupported: each thread needs its own copy) interleave: a run that leaves a place
# that a later run (another thread's) entered too does not touch it, and hands that run what it found
# instead, so the place ends as it was before either, never holding a run's stand-in for good. And a
# call that would take another thread's stand-in for a module's tensor raises (its gradient would
# go there). The bookkeeping is per run, not per place: a place is looked at only where runs overlap.
_runs: list[reparametrized] = []
_runs_by_thread: dict[int, int] = {}  # thread -> how many of its runs hold places now
_runs_lock = threading.RLock()  # (re-entrant: setting a module attribute may run user code)

_SAME_MODULE_IN_TWO_THREADS = (
    "two threads ran the same module at once. remat puts each run's stand-ins into the module's "
    "attributes while it runs (as torch.func.functional_call does), so a module object must not "
    "be run, or differentiated, by two threads at the same time: give each thread its own copy."
)


def _placed_by_other_threads() -> set[int]:
    """The ids of the stand-ins that runs of other threads have in modules now.

    A place a run left holding its own tensor (a buffer, a frozen weight: the Function's
    input is the tensor itself) holds no stand-in: another thread's module may share that
    tensor (a mask or frozen embedding registered on two models) and reach it rightly."""
    me = threading.get_ident()
    if not _runs_by_thread or _runs_by_thread.keys() == {me}:  # the common case: no other thread is in a run
        return set()
    with _runs_lock:
        return {id(entry[3]) for run in _runs if run.thread != me for entry in run.swapped if entry[3] is not entry[2]}


def refuse_other_threads_stand_ins(name: str, tensors: list[torch.Tensor]) -> None:
    """Raise if a call found another thread's stand-in where a module's tensor sits."""
    others = _placed_by_other_threads()
    for t in tensors:
        if id(t) in others:
            raise CheckpointError(
                f"remat({name}): the call found another thread's stand-in for a module's tensor "
                f"(shape {tuple(t.shape)}): {_SAME_MODULE_IN_TWO_THREADS}"
            )


class reparametrized:
    """Put ``replace[id(t)]`` in each module wherever ``t`` sat at the call (``captured.places``).

    What ``torch.func.functional_call``'s reparametrization does (a parameter or
    buffer entry replaced in its dict, any other attribute set), with the places
    found once by :func:`find_captured` rather than looked up by dotted name on
    every run. Leaving puts back what each place held, in reverse order, so a
    place named twice (a shared submodule) ends as it was.

    A place the function rebound while it ran (``self.count = self.count + 1``,
    ConViT's ``self.rel_indices = ...`` on a registered buffer) holds the function's
    new value instead: with ``keep_rebound`` (the forward run) that value stays, as it
    would without remat; otherwise (a recomputation, or a run that raised) it is dropped,
    so the state is updated once per forward pass. A rebound value with a graph stays too
    where the run computed it (from ``first_node`` on): it escapes the run, and is an output
    of the call where it can be. One with a graph from elsewhere (an input's local copy,
    a tensor from before the call) raises, except the weight that the old-style
    ``nn.utils.spectral_norm`` and ``weight_norm`` pre-hooks compute at every call, kept
    detached (the next call computes it again before reading it).

    A module a place of which the forward run rebound has its plain attributes put back with
    it for a recomputation (:class:`attributes_as_at_the_call`): those the run rebound too,
    recorded into ``attributes``. They describe that tensor (HF's ``dynamic_rope_update``
    rebinds the ``inv_freq`` buffer with ``self.max_seq_len_cached`` and branches on the
    latter: a recomputation seeing the call's buffer but the run's length would skip the
    update and compute something else). So do the plain attributes the forward run rebound on
    every module it reaches where the run wrote an input in place (``written``, the inputs
    snapshotted before their first write, non-empty after the run): the recomputation starts
    from the snapshots, the values at the call, and a flag guarding the write must be as at the
    call too (HF RWKV rescales its weights in place under ``no_grad`` once and sets
    ``self.layers_are_rescaled``; Glow's ActNorm initializes its parameters from its first batch
    and sets ``self.initialized``): with the run's flag the recomputation would skip the write and
    compute something else, a ``CheckpointError`` on a correct program. Otherwise a plain
    attribute rebound alone (``self.calls += 1``) is left as the runs leave it, as under
    ``torch.utils.checkpoint``: the recomputation counts too.
    """

    __slots__ = (
        "attributes", "by_name", "captured", "first_node", "keep_rebound", "loop", "replace", "snapshots", "swapped",
        "thread", "written",
    )  # fmt: skip

    def __init__(
        self,
        captured: Captured,
        replace: dict[int, torch.Tensor],
        keep_rebound: bool = False,
        loop: str | None = None,
        first_node: int | None = None,
        attributes: list[tuple[torch.nn.Module, str, Any]] | None = None,
        written: Collection[Any] = (),
    ) -> None:
        # ``loop``: the name of a checkpointed loop whose forward sweep this is. Its steps run again
        # from kept carries, in the schedule's order, and cannot replay state a step rebinds: refused.
        # ``first_node``: the run's first autograd node; a rebound value whose graph starts there or
        # later was computed by the run, and escapes it (UserRegion._escaped_tensors says what then).
        self.captured, self.replace, self.keep_rebound, self.loop = captured, replace, keep_rebound, loop
        self.first_node = first_node
        # ``attributes``: in a forward run, where to record the plain attributes to put back for a
        # recomputation (see above), from ``snapshots`` of the modules' attributes at the call.
        self.attributes = attributes
        # ``written``: the snapshots of the inputs the run writes in place (filled while it runs).
        self.written = written
        self.snapshots: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        # each place set: ``[module, key, what it held before, what this run put there]``
        self.swapped: list[list[Any]] = []
        self.thread: int | None = None  # the thread whose run holds the places, while it does
        self.by_name = False  # were the places looked up again (a submodule replaced since the call)?

    def __enter__(self) -> None:
        replace, swapped = self.replace, self.swapped
        try:
            captured = self.captured
            try:
                unchanged = all(parent._modules.get(name) is child for parent, name, child in captured.edges)
            except AttributeError:  # a TorchScript module's dictionary of submodules, which has no get()
                unchanged = all(submodule(parent, name) is child for parent, name, child in captured.edges)
            self.by_name = not unchanged
            groups = captured.places if unchanged else _places_by_name(captured)
            me = threading.get_ident()
            with _runs_lock:
                _runs.append(self)
                _runs_by_thread[me] = _runs_by_thread.get(me, 0) + 1
                self.thread = me
                for places in groups:
                    for owner, key, t in places:
                        placed = replace.get(id(t), t)
                        swapped.append([owner, key, _swap_tensor(owner, key, placed), placed])
            if self.attributes is not None:
                self.snapshots = _attribute_snapshots(captured)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._leave(exc)
        finally:
            if self.thread is not None or self.swapped:
                # Left unfinished: an asynchronous exception (a KeyboardInterrupt, a signal handler's)
                # landed in it. The places still go back, and the run leaves the registry: a module
                # holding a run's stand-ins for good would train them instead of its parameters.
                with _runs_lock:
                    self._put_back(self._unregister(), False, set(), [], [])

    def _unregister(self) -> list[reparametrized]:
        """Take this run out of the registry of runs (under ``_runs_lock``); return the runs of other
        threads that entered after it. Also after an interruption left it half done (its thread's
        count is told again from the runs left)."""
        thread = self.thread
        # (the last one, but where threads overlap)
        at = next((i for i in range(len(_runs) - 1, -1, -1) if _runs[i] is self), None)
        later = [] if at is None else _runs[at + 1 :]
        if at is not None:
            del _runs[at]
        if thread is not None:
            count = sum(run.thread == thread for run in _runs)
            if count:
                _runs_by_thread[thread] = count
            else:
                _runs_by_thread.pop(thread, None)
        self.thread = None
        return later

    def _put_back(
        self,
        later: list[reparametrized],
        keep: bool,
        rebound_owners: set[int],
        in_loop: list[tuple[torch.nn.Module, str]],
        with_graph: list[tuple[torch.nn.Module, str, torch.Tensor]],
    ) -> None:
        """Put back what each place held before the run, last set first, taking each off ``swapped``
        once done (so that what an interruption leaves is still there to put back)."""
        swapped = self.swapped
        while swapped:
            owner, key, before, placed = swapped[-1]
            if later:
                after = next((e for run in later for e in run.swapped if e[0] is owner and e[1] == key), None)
                if after is not None:  # a later run holds this place too: it puts this back
                    after[2] = before
                    swapped.pop()
                    continue
            if keep:
                held = _held(owner, key)
                if held is not placed:
                    rebound_owners.add(id(owner))
                    if _recomputed_at_every_call(owner, key) and isinstance(held, torch.Tensor):
                        # Its value, without the run's local graph: a later call (which computes it
                        # again) then does not route the stale weight, and its graph, through remat.
                        _swap_tensor(owner, key, held.detach())
                        swapped.pop()
                        continue
                    if self.loop is not None:
                        in_loop.append((owner, key))
                    elif not (isinstance(held, torch.Tensor) and held.requires_grad):
                        swapped.pop()
                        continue  # rebound by the function: its value stays, as without remat
                    elif self._computed_in_the_run(held):
                        swapped.pop()
                        continue  # (an MoE layer's self.aux_loss: it escapes the run, see above)
                    else:
                        with_graph.append((owner, key, held))
            _swap_tensor(owner, key, before)
            swapped.pop()

    def _leave(self, exc: tuple[Any, ...]) -> None:
        keep = self.keep_rebound and exc[:1] in ((), (None,))
        with_graph: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        in_loop: list[tuple[torch.nn.Module, str]] = []
        snapshots, self.snapshots = self.snapshots, []
        rebound_owners: set[int] = set()  # the modules a place of which the function rebound
        with _runs_lock:
            self._put_back(self._unregister(), keep, rebound_owners, in_loop, with_graph)
        if self.attributes is not None:
            restarts = bool(self.written)  # (the recomputation starts from inputs as at the call)
            for m, then in snapshots:
                now = m.__dict__
                if now.keys() == then.keys() and all(map(operator.is_, now.values(), then.values())):
                    continue  # (the common case, told in C: nothing rebound)
                if restarts or id(m) in rebound_owners:
                    found = _plain_rebinds(m, then)
                else:  # (a module none of whose places the run rebound)
                    found = _new_tensor_state(m, then)
                self.attributes += found + _kept_where_none_was(m, then, found)
        if in_loop:
            owner, key = in_loop[-1]
            raise CheckpointError(
                f"scan({self.loop}): a step rebound {type(owner).__name__}.{key} (module state such as "
                "self.count = self.count + 1 or an out-of-place running average). A checkpointed loop "
                "runs steps again from its kept carries, in the schedule's order, and cannot replay "
                "such updates. Carry the state in the loop's carry, or write the loop in Python with "
                "funckpt.remat on each step (for x in xs: carry, y = funckpt.remat(f)(carry, x)), "
                "which replays them."
            )
        if with_graph:
            owner, key, held = with_graph[-1]  # the first one rebound, in module order
            raise CheckpointError(
                f"remat: the function rebound {type(owner).__name__}.{key} to a tensor of shape "
                f"{tuple(held.shape)} computed with a graph (it requires grad), such as an "
                "exponential average of activations that are not detached. remat records no graph "
                "for it in the caller's autograd: kept, a later use of it would get a silently "
                "missing gradient; dropped, the module's state (and every later call's values) "
                "would differ from the model's without remat. Detach it (or compute it under "
                "torch.no_grad()) if it is state, or return it from the function if it is to be "
                "differentiated."
            )


    def _computed_in_the_run(self, t: torch.Tensor) -> bool:
        node = t.grad_fn
        return self.first_node is not None and node is not None and node._sequence_nr() >= self.first_node


_ABSENT = object()


def _recomputed_at_every_call(owner: torch.nn.Module, key: str) -> bool:
    """Is ``owner.key`` set by one of its forward pre-hooks at every call, before the forward reads
    it (the old-style ``nn.utils.spectral_norm`` and ``weight_norm`` compute ``weight`` so, and
    ``nn.utils.prune`` computes ``weight_orig * weight_mask``)? Then the forward run's value is kept
    detached: the next call computes it again before any use."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return any(
        (isinstance(hook, (SpectralNorm, WeightNorm)) and hook.name == key)
        or (isinstance(hook, BasePruningMethod) and getattr(hook, "_tensor_name", None) == key)
        for hook in owner._forward_pre_hooks.values()
    )


def _held(owner: torch.nn.Module, key: str) -> Any:
    """What ``owner``'s parameter, buffer or attribute ``key`` holds (``_ABSENT`` where nothing)."""
    entries: dict[str, Any] = owner._parameters
    if key in entries or key in (entries := owner._buffers):
        return entries[key]
    return owner.__dict__.get(key, _ABSENT)


def _swap_tensor(owner: torch.nn.Module, key: str, value: Any) -> Any:
    """Set ``owner``'s parameter, buffer or attribute ``key`` to ``value``; return what it held
    (``_ABSENT`` where it held nothing, and setting ``_ABSENT`` removes it)."""
    entries: dict[str, Any] = owner._parameters
    if key in entries or key in (entries := owner._buffers):
        before = entries[key]
        if value is _ABSENT:
            del entries[key]
        else:
            entries[key] = value
        return before
    before = owner.__dict__.get(key, _ABSENT)
    if value is _ABSENT:
        owner.__dict__.pop(key, None)
    else:
        setattr(owner, key, value)
    return before


#: Methods that set a module's attributes outside its forward: not looked at by :func:`_stores_attributes`.
_SETUP_METHODS = frozenset({
    "__init__", "__setstate__", "__getstate__", "__setattr__", "__delattr__", "reset_parameters",
    "_reset_parameters", "_init_weights", "extra_repr", "_load_from_state_dict", "load_state_dict",
    "_apply", "train", "eval", "to", "share_memory", "register_buffer", "register_parameter",
})  # fmt: skip
_STORES: dict[type, bool] = {}


def _code_stores(code: types.CodeType) -> bool:
    # (``setattr(self, name, v)`` and ``self.__dict__[name] = v`` store attributes too)
    if "setattr" in code.co_names or "__dict__" in code.co_names:
        return True
    if any(ins.opname == "STORE_ATTR" for ins in dis.get_instructions(code)):
        return True
    return any(isinstance(c, types.CodeType) and _code_stores(c) for c in code.co_consts)


def _function_stores(fn: Any, depth: int = 0) -> bool:
    """Does ``fn``'s code store an attribute, or that of the function it wraps? A decorated
    ``forward`` (``functools.wraps``: HF's ``@can_return_tuple``, ``@deprecate_kwarg``) is a
    wrapper whose own code calls the method from its closure."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    if _code_stores(code):
        return True
    if depth >= 4:
        return False
    inner = [getattr(fn, "__wrapped__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # (an empty cell)
            pass
    return any(f is not fn and isinstance(f, types.FunctionType) and _function_stores(f, depth + 1) for f in inner)


def _stores_attributes(cls: type) -> bool:
    """Does code of ``cls`` (below ``nn.Module``) assign an attribute (``self.last = x``,
    ``self.calls += 1``) outside its set-up methods? Read once per class from its bytecode; an
    over-estimate (any attribute store, of any object) only costs :func:`stored_attributes` a walk."""
    found = _STORES.get(cls)
    if found is None:
        found = False
        for klass in cls.__mro__:
            if klass is torch.nn.Module or klass is object or klass.__module__.startswith("torch.nn."):
                continue
            for name, value in vars(klass).items():
                value = getattr(value, "__func__", value)  # (staticmethod, classmethod)
                setup = name in _SETUP_METHODS or (name.startswith("__") and name != "__call__")  # (__init_subclass__)
                if not setup and _function_stores(value):
                    found = True
                    break
            if found:
                break
        _STORES[cls] = found
    return found


def _modules_reached(captured: Captured) -> list[torch.nn.Module]:
    """The modules ``captured`` reaches, each once."""
    if not captured.modules:
        return []
    modules = {id(m): m for m, _ in captured.modules}
    for _, _, child in captured.edges:
        if isinstance(child, torch.nn.Module):
            modules.setdefault(id(child), child)
    return list(modules.values())


_SCALARS = frozenset({bool, int, float, str, type(None)})


def stored_attributes(captured: Captured) -> list[Any]:
    """The values of the attributes (not the parameters, buffers, submodules or hooks) of the
    modules ``captured`` reaches whose class stores attributes (:func:`_stores_attributes`):
    where a function's own code keeps what it computed or was given (``self.last = x``)."""
    return [
        value
        for m in _modules_reached(captured)
        if _stores_attributes(type(m))
        for key, value in m.__dict__.items()
        if key not in ("_parameters", "_buffers", "_modules") and "hooks" not in key and type(value) not in _SCALARS
    ]


class training_as_at_the_call:
    """Put each module's ``training`` flag back to what it was at the call, for a recomputation.

    ``model.eval()`` between the forward and the backward pass (an evaluation, a
    callback) must not turn the recomputation's dropout off or its BatchNorm to
    running statistics: the gradient is the forward pass's computation's. The
    flags are restored on leaving.

    So are the modules' hooks: full backward hooks and pre-hooks, forward hooks and pre-hooks
    (``hooks``: those the forward run found, :func:`backward_hooks_now`). Without remat a module's
    call takes them as they are then: its graph runs the backward ones in the backward pass, also
    when the caller removed them in between (a handle removed after the forward pass), and not one
    registered since; the forward ones made the values the gradient is of. A recomputation calls
    the module again, and would take them as they are in the backward pass: a gradient hook
    silently missing, or one more; a forward hook that changes an output (an activation patch
    removed once the forward pass is done) computing another one (a false "did not reproduce", a
    wrong gradient with the check off). So it gets those it had at the call, in dicts of its own,
    and the module its own dicts back on leaving (those the handles edit). (A hook the function
    registers itself is registered again by the recomputation, there only.) One walk over the
    modules does both.
    """

    def __init__(
        self,
        flags: Sequence[tuple[torch.nn.Module, bool]],
        hooks: Sequence[tuple[torch.nn.Module, tuple[dict[int, Any], ...]]] = (),
    ) -> None:
        self.flags, self.hooks = flags, hooks
        self.changed: list[tuple[torch.nn.Module, bool]] = []  # (module, its flag before)
        self.rehooked: list[tuple[torch.nn.Module, list[Any]]] = []  # (module, its dicts)

    def __enter__(self) -> None:
        then = {id(m): dicts for m, dicts in self.hooks} if self.hooks else None
        for module, training in self.flags:
            if module.training != training:
                self.changed.append((module, module.training))
                module.training = training
            if (
                module._backward_hooks
                or module._backward_pre_hooks
                or module._forward_hooks
                or module._forward_pre_hooks
                or (then is not None and id(module) in then)
            ):
                self._hooks_as_then(module, _NO_HOOKS if then is None else then.get(id(module), _NO_HOOKS))

    def _hooks_as_then(self, module: torch.nn.Module, had: tuple[dict[int, Any], ...]) -> None:
        if any(getattr(module, name).keys() != hooks.keys() for name, hooks in zip(_MODULE_HOOKS, had)):
            self.rehooked.append((module, [getattr(module, name) for name in _MODULE_HOOK_DICTS]))
            for name, hooks in zip(_MODULE_HOOK_DICTS, had):
                setattr(module, name, collections.OrderedDict(hooks))

    def __exit__(self, *exc: Any) -> None:
        changed, self.changed = self.changed, []
        for module, before in reversed(changed):
            module.training = before
        rehooked, self.rehooked = self.rehooked, []
        for module, dicts in reversed(rehooked):
            for name, hooks in zip(_MODULE_HOOK_DICTS, dicts):
                setattr(module, name, hooks)


#: A module's dicts of hooks that its call reads (see :class:`training_as_at_the_call`), and after
#: them those of the flags of its forward hooks, keyed as they are.
_MODULE_HOOKS = ("_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks")
_MODULE_HOOK_DICTS = (
    *_MODULE_HOOKS, "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"
)


def backward_hooks_now(
    modules: Sequence[tuple[torch.nn.Module, bool]],
) -> list[tuple[torch.nn.Module, tuple[dict[int, Any], ...]]]:
    """The modules among ``modules`` (``Captured.training``) that have backward or forward hooks or
    pre-hooks now, each with a copy of its dicts of them (see :class:`training_as_at_the_call`)."""
    return [
        (m, tuple(dict(getattr(m, name)) for name in _MODULE_HOOK_DICTS))
        for m, _ in modules
        if m._backward_hooks or m._backward_pre_hooks or m._forward_hooks or m._forward_pre_hooks
    ]


_NO_HOOKS: tuple[dict[int, Any], ...] = tuple({} for _ in _MODULE_HOOK_DICTS)


#: Values of a module attribute that a recomputation puts back as they were at the call: numbers,
#: strings, flags, dtypes, devices, shapes (``self.max_seq_len_cached``, ``self.attention_scaling``).
_PLAIN_VALUES = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size})


def _plain(value: Any) -> bool:
    kind = type(value)
    return kind in _PLAIN_VALUES or value is _ABSENT or (kind is tuple and all(type(v) in _PLAIN_VALUES for v in value))


def _attribute_snapshots(captured: Captured) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """A shallow copy of the attributes of each module ``captured`` reaches whose class stores
    attributes (:func:`_stores_attributes`), for :func:`_plain_rebinds` after a forward run."""
    known = _STORES.get  # (the classes' answers, read once each: here without a call per module)
    return [
        (m, dict(m.__dict__))
        for m, _ in captured.training
        if known(type(m)) or (type(m) not in _STORES and _stores_attributes(type(m)))
    ]


def _plain_rebinds(m: torch.nn.Module, then: dict[str, Any]) -> list[tuple[torch.nn.Module, str, Any]]:
    """``(m, key, value at the call)`` for each attribute of ``m`` that held a plain value at the
    call (:data:`_PLAIN_VALUES`, or nothing) and now holds another plain value or a tensor
    without a graph (HF's cached length is ``torch.max(position_ids) + 1``); a tensor with a
    graph is an escape of the run, seen elsewhere."""
    now = m.__dict__
    if now.keys() == then.keys() and all(map(operator.is_, now.values(), then.values())):
        return []  # (the common case, told in C: nothing rebound)
    found = []
    for key, value in now.items():
        old = then.get(key, _ABSENT)
        if old is not value and key != "training" and _plain(old) and _now_recorded(value):
            found.append((m, key, old))
    for key in then.keys() - now.keys():  # (deleted by the run)
        if _plain(then[key]):
            found.append((m, key, then[key]))
    return found


def _new_tensor_state(m: torch.nn.Module, then: dict[str, Any]) -> list[tuple[torch.nn.Module, str, Any]]:
    """:func:`_plain_rebinds` of ``m`` where the run set one of its attributes that held no tensor at
    the call (``None``, or nothing) to a tensor without a graph: state the module starts on its first
    call (``if self.hidden is None: ...; self.hidden = h.detach()``, an RNN's hidden state carried
    across batches), which no place of the call holds. The recomputation starts from ``None`` as the
    forward run did, where it would otherwise read the forward run's new tensor and compute something
    else (a ``CheckpointError``); the rebound tensor itself stays, as without remat."""
    for key, value in m.__dict__.items():
        if isinstance(value, torch.Tensor) and not value.requires_grad and _plain(then.get(key, _ABSENT)):
            return _plain_rebinds(m, then)
    return []


def _kept_where_none_was(
    m: torch.nn.Module, then: dict[str, Any], found: list[tuple[torch.nn.Module, str, Any]]
) -> list[tuple[torch.nn.Module, str, Any]]:
    """``(m, key, value at the call)`` for each attribute of ``m`` that held no tensor at the call
    (``None``, or nothing) and now holds a tensor with a graph (``self.last = h``, which the module
    adds to its next output), or that held the tensor such an attribute kept at an earlier call
    whose backward pass has run (:func:`spent_escape`: the next step's call, which reads it and
    rebinds it again; not routed into the call, so no place of it puts it back), not in ``found``
    already.

    Such a tensor escapes the run and is made an output of the call (a tensor kept outside it); the
    recomputation must start from what the attribute held at the call, as the forward run did, or it
    reads the new tensor and computes something else (a ``CheckpointError`` on a correct program).
    Only that attribute: the module's other plain attributes (a count of its calls) are left to the
    recomputation, as under ``torch.utils.checkpoint`` (unlike a module's state,
    :func:`_new_tensor_state`)."""
    listed = {key for _, key, _ in found}
    kept = []
    for key, value in m.__dict__.items():
        if isinstance(value, torch.Tensor) and key not in listed:
            old = then.get(key, _ABSENT)
            if old is not value and ((value.requires_grad and _plain(old)) or (isinstance(old, torch.Tensor) and spent_escape(old))):
                kept.append((m, key, old))
    return kept


def _now_recorded(value: Any) -> bool:
    return _plain(value) or (isinstance(value, torch.Tensor) and not value.requires_grad)


class attributes_as_at_the_call:
    """Put the plain attributes a forward run rebound with a tensor place of their module (see
    :class:`reparametrized`) back to their values at the call for a recomputation, and what
    they hold now back on leaving: the forward run updated them once, as without remat."""

    __slots__ = ("found", "rebound")

    def __init__(self, rebound: Sequence[tuple[torch.nn.Module, str, Any]]) -> None:
        self.rebound = rebound
        self.found: list[tuple[torch.nn.Module, str, Any]] = []

    def __enter__(self) -> None:
        self.found = [(m, key, m.__dict__.get(key, _ABSENT)) for m, key, _ in self.rebound]
        for m, key, value in self.rebound:
            _set_attribute(m, key, value)

    def __exit__(self, *exc: Any) -> None:
        found, self.found = self.found, []
        for m, key, value in reversed(found):
            _set_attribute(m, key, value)


def _set_attribute(m: torch.nn.Module, key: str, value: Any) -> None:
    # (In the instance's dict, as the function's own assignment put it there: a class's
    # __setattr__, or nn.Module's for a tensor, would do more than undo that assignment.)
    if value is _ABSENT:
        m.__dict__.pop(key, None)
    else:
        m.__dict__[key] = value


def _is_library(fn: types.FunctionType) -> bool:
    """Is ``fn`` library code (torch's, funckpt's, ...), whose closure and globals hold no tensor of the user's?

    Told by both the module whose globals it runs with and its ``__module__``: a decorator's
    wrapper made with ``functools.wraps`` takes the ``__module__`` of what it wraps. A user's
    wrapper around ``nn.Linear.forward`` (multiplying by a tensor of its closure) is the user's
    code; so is torch's or funckpt's own wrapper around a user's function (``remat(f)``
    called inside another remat'd function: its closure holds ``f``)."""
    return _library_module(fn.__globals__.get("__name__") or "") and _library_module(getattr(fn, "__module__", None) or "")


@functools.lru_cache(maxsize=1024)
def _library_module(module: str) -> bool:
    return module.split(".")[0] in _LIBRARY_ROOTS


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names the code (and the code nested in it) loads as globals.

    Not ``co_names``, which also holds attribute names: ``self.weight`` must not
    capture a global that happens to be called ``weight``.
    """
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(global_names(const))
    return tuple(sorted(names))


#: The instructions that load a variable a chain of attribute reads may start from, by the kind of
#: place :func:`_keyed_parts` names it with.
_VARIABLE_LOADS = {
    "LOAD_GLOBAL": "global",
    "LOAD_NAME": "global",
    "LOAD_DEREF": "variable",
    "LOAD_CLASSDEREF": "variable",
}


@functools.lru_cache(maxsize=4096)
def _attribute_chains(code: types.CodeType) -> tuple[tuple[str, str, tuple[tuple[str, ...], ...]], ...]:
    """The attribute reads the code (and the code nested in it) makes right after loading a global
    or closure variable, by variable: ``params.tables.shift`` and ``params.W`` give
    ``("global", "params", (("tables", "shift"), ("W",)))``.

    What :func:`module_reads` follows into the user's Python modules, which the walk does not
    enter whole (one reaches every module it imports); a read chain names exactly what the code
    takes from it.
    """
    chains: dict[tuple[str, str], dict[tuple[str, ...], None]] = {}
    start: tuple[str, str] | None = None
    attributes: list[str] = []
    for instruction in [*dis.get_instructions(code), None]:
        if instruction is not None and start is not None and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            attributes.append(instruction.argval)
            continue
        if start is not None and attributes:
            chains.setdefault(start, {})[tuple(attributes)] = None
        start, attributes = None, []
        if instruction is not None and instruction.opname in _VARIABLE_LOADS and isinstance(instruction.argval, str):
            start = (_VARIABLE_LOADS[instruction.opname], instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # (its globals are the function's; its free variables its own)
            for kind, name, reads in _attribute_chains(const):
                if kind == "global":
                    chains.setdefault((kind, name), {}).update(dict.fromkeys(reads))
    return tuple((kind, name, tuple(reads)) for (kind, name), reads in chains.items())


@functools.lru_cache(maxsize=4096)
def _chained_names(code: types.CodeType) -> frozenset[str]:
    """The globals whose attributes the code reads (see :func:`_attribute_chains`)."""
    return frozenset(name for kind, name, _ in _attribute_chains(code) if kind == "global")


#: Where installed packages live (site-packages, a virtual environment's included): a module from there
#: is a third party's (transformers, timm), not the user's own, which an editable install leaves in place.
_INSTALLED = tuple(
    {os.path.join(os.path.realpath(p), "") for p in (*getattr(site, "getsitepackages", list)(), getattr(site, "getusersitepackages", str)(),
     sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]) if p}
)  # fmt: skip

#: :func:`_is_users_module` by the module itself (a dict lookup per call, not a path to read).
_users_modules: dict[types.ModuleType, bool] = {}


def _is_users_module(module: types.ModuleType) -> bool:
    """Is the Python module the user's: not library code (torch's, funckpt's), nor the standard
    library's, nor installed as a package (:data:`_INSTALLED`)? What a function reads off a third
    party's module (``transformers.activations.ACT2FN``) is that library's, whose code is walked
    through its own functions' globals where the user's function calls them, not through everything
    its modules hold (following ``ACT2FN`` cost a Hugging Face layer's walk 4x)."""
    known = _users_modules.get(module)
    if known is None:
        root = (getattr(module, "__name__", "") or "").split(".")[0]
        path = getattr(module, "__file__", None)
        installed = isinstance(path, str) and os.path.realpath(path).startswith(_INSTALLED)
        library = _library_module(root) or root in getattr(sys, "stdlib_module_names", ())
        known = _users_modules[module] = not library and not installed
    return known


def module_reads(fn: types.FunctionType) -> list[tuple[str, str, Any]]:
    """What ``fn``'s code reads off the user's Python modules it names as globals or closure
    variables (``import params`` and ``params.W``, ``params.tables.shift``, ``params.helper``):
    ``(kind, dotted name, value)`` for each chain, the value the first one along it that is not a
    module itself (``params.tables.shift`` follows the submodule ``tables``).

    The walk does not enter a Python module (one reaches everything it imports), so without these
    a tensor the function reads off one would be unreachable: refused as foreign, where the
    function without remat gives it its gradient. Attributes are read from the module's
    ``__dict__``, not with ``getattr``, so that a module's lazy ``__getattr__`` imports nothing.
    """
    chains = _attribute_chains(fn.__code__)
    if not chains:
        return []
    cells: dict[str, Any] | None = None
    reads: list[tuple[str, str, Any]] = []
    for kind, name, chains_of_name in chains:
        if kind == "global":
            value = fn.__globals__.get(name, _MISSING)
        else:
            if cells is None:
                cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
            try:
                value = cells[name].cell_contents if name in cells else _MISSING
            except ValueError:  # an empty cell
                value = _MISSING
        if not isinstance(value, types.ModuleType) or not _is_users_module(value):
            continue
        for attributes in chains_of_name:
            held, dotted = value, name
            for attribute in attributes:
                held = vars(held).get(attribute, _MISSING)
                dotted += f".{attribute}"
                if not isinstance(held, types.ModuleType):
                    break
            if held is not _MISSING and not isinstance(held, types.ModuleType):
                reads.append((kind, dotted, held))
    return reads


# ------------------------------------------------------------------ substitution


class _Active(threading.local):
    def __init__(self) -> None:
        self.substitutes: list[Substitute] = []  # the substitutions of the runs we are inside, innermost last
        # Inside funckpt's own work for a region applied in a run (a nested remat's forward run, but
        # not its function): the enclosing runs do not count the tensors made there, so the
        # positions of their escaped tensors (Substitute.made) are those of the user's code alone.
        self.internal = False
        # Is a hook being registered by _register_followed_hook (the enclosing runs' modes pass it on)?
        self.registering = False
        # How many backward passes that a later differentiation recomputes (a VjpRegion's) are on
        # (see _RemovingTheFollowed).
        self.replayable_backward = 0
        # The recomputations in progress that run without the substitution mode, innermost last:
        # where each started (its first autograd node) and its inputs (see enter_unwatched).
        self.unwatched: list[tuple[int, Sequence[torch.Tensor]]] = []


def set_internal(internal: bool) -> bool:
    """Mark what runs next on this thread as funckpt's own work (``True``) or the user's; returns the previous mark."""
    was, _active.internal = _active.internal, internal
    return was


_active = _Active()


def _register_followed_hook(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], among: Sequence[Substitute] | None = None
) -> Any:
    """``h.register_hook(hook)`` on a tensor a run made, for every run it is made in (this thread's
    substitutions: a remat'd call's forward run, nested in another's, is made in both).

    A recomputation registers the hook again on the tensor its backward pass goes through, where
    without remat the forward pass's tensor has it: the handle the function got in the forward run
    must still remove it. So each forward run notes each such hook's dict of hooks (which that handle
    edits) and key, and each recomputation registers the hook as one that runs only while the key
    noted at its forward run's registration in the same order is there (:class:`FollowingItsHandle`).
    (Once, by the innermost run's mode: an enclosing one's, passed the call on, lets it through.)
    ``among``: the runs that made the tensor, where not every one did (one nested in them gets it
    as an input, whose hooks it moves to its caller's tensor: see ``funckpt._call._move_input_hooks``).
    """

    def register(follow: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
        if args[1:]:
            return func(args[0], follow(args[1]), *args[2:], **kwargs)
        if "hook" in kwargs:
            return func(*args, **{**kwargs, "hook": follow(kwargs["hook"])})
        return func(*args, **kwargs)

    return _following(register, among)


def _following(
    register: Callable[[Callable[[Callable[..., Any]], Callable[..., Any]]], Any],
    among: Sequence[Substitute] | None = None,
) -> Any:
    """Register a hook for the runs on this thread (see :func:`_register_followed_hook`):
    ``register(follow)`` registers ``follow(hook)`` and returns its handle. (``among``: the runs
    whose graph the hook may be on, where not every one's: see :func:`_register_node_hook`.)"""
    runs = [s for s in (_active.substitutes if among is None else among) if s.hooks is not None]
    handles: Handles = ()
    for run in runs:
        if not run.forward:
            assert run.hooks is not None
            n, run.hooks_seen = run.hooks_seen, run.hooks_seen + 1
            if n < len(run.hooks):
                mine, key, followed = run.hooks[n]
                # (Removed in the forward run itself, after a gradient of its own went through it:
                # the recomputation removes it again at the same point, by its own handle.)
                handles += followed if mine is None else ((mine, key), *followed)
    was, _active.registering = _active.registering, True
    try:
        handle = register((lambda hook: FollowingItsHandle(hook, handles)) if handles else (lambda hook: hook))
    finally:
        _active.registering = was
    registered_in = getattr(handle, "hooks_dict_ref", lambda: None)()
    if handles and type(handle) is RemovableHandle:
        handle.__class__ = _RemovingTheFollowed
        cast(_RemovingTheFollowed, handle).followed = handles
    if isinstance(registered_in, dict) and getattr(handle, "id", None) in registered_in:
        for run in runs:
            if run.forward:
                assert run.hooks is not None
                run.hooks.append((registered_in, handle.id, handles))
    return handle


def _note_hooks() -> None:
    """A hook is registered: note it in this thread's forward runs (see ``Substitute.any_hooks``)."""
    for run in _active.substitutes:
        if run.forward:
            run.any_hooks = True


def _register_node_hook(hooks: Any, hook: Callable[..., Any]) -> tuple[Any, Any]:
    """``h.grad_fn.register_hook(hook)``, ``register_prehook``: every hook registered on an autograd
    node goes through here (see :func:`funckpt._internals.route_node_hooks`).

    In a remat'd call's run, a hook on a node of the graph it records is followed as a tensor hook
    is (:func:`_register_followed_hook`): the recomputation registers it again on its own node, the
    one the backward pass goes through, and there it runs only while the handle the forward run
    returned has not removed it; removed by the recomputation's handle (the hook removing itself
    when it first runs), it does not run in a second backward pass through the same graph either.
    (Not followed, a hook the caller removed between the forward and the backward pass ran all the
    same, and one removing itself ran again at each backward pass: ``torch.utils.checkpoint`` keeps
    the forward pass's nodes, and runs it once.) Elsewhere, as torch registers it.
    """
    if not _active.substitutes or _active.internal or _active.registering:
        return register_node_hook(hooks, hook)
    _note_hooks()
    # The runs that gave this node as one of their inputs' ``x.grad_fn`` (see CallersNodes), outermost first.
    owners = [] if hooks is None else [s for s in _active.substitutes if s.callers_nodes is not None and id(hooks) in s.callers_nodes.dicts]
    if owners:
        # The innermost recomputation among them registers nothing: its forward run registered this hook
        # (the forward runs nested in it, made again, note the handle to that one); else it is registered
        # once, followed by the runs around the outermost (whose own graph the node may be on).
        again = next((k for k in range(len(owners) - 1, -1, -1) if not owners[k].forward), None)
        if again is not None:
            callers = owners[again].callers_nodes
            assert callers is not None
            mine, handle = hooks, callers.registered_again(owners[again])
            owners = owners[again + 1 :]
        else:
            mine, handle = _register_node_hook_followed(hooks, hook, _active.substitutes[: _active.substitutes.index(owners[0])])
        for s in owners:
            assert s.callers_nodes is not None
            s.callers_nodes.registered(mine, handle)
        return mine, handle
    return _register_node_hook_followed(hooks, hook, None)


def _register_node_hook_followed(hooks: Any, hook: Callable[..., Any], among: Sequence[Substitute] | None) -> tuple[Any, Any]:
    """Register ``hook`` on an autograd node, followed by the runs ``among`` (all, if ``None``) that
    follow hooks (see :func:`_register_node_hook`)."""
    if not any(s.hooks is not None for s in (_active.substitutes if among is None else among)):
        return register_node_hook(hooks, hook)
    registered: list[Any] = []

    def register(follow: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
        mine, handle = register_node_hook(hooks, follow(hook))
        registered.append(mine)
        return handle

    handle = _following(register, among)
    return registered[0], handle


route_node_hooks(_register_node_hook)


class CallersNodes:
    """The autograd nodes of the caller's tensors that a remat'd call's function read (``x.grad_fn``
    of an input or of a tensor it closes over), and the hooks it registered on them.

    Without remat the function gets the caller's tensors, whose ``grad_fn`` is the node that made
    them: a hook registered there (``c.grad_fn.register_prehook(...)``) changes the gradient that
    goes on to the caller's graph, and code may branch on ``x.grad_fn is None``. The forward run's
    inputs are leaves of its own, whose ``grad_fn`` is ``None``: the hook was an ``AttributeError``,
    and a branch on it silently skipped. So a run gives the caller's node where the function reads
    an input's ``grad_fn`` (:meth:`Substitute._callers_read`). A hook the forward run registers there
    is registered once, as without remat; the recomputation, which reads the same node, registers
    it again nowhere: it gets a handle to the forward run's hook, by order (:meth:`registered_again`).

    The forward run makes the node's dicts of hooks itself when it hands it out (a node has none
    until a hook is registered, and :func:`_register_node_hook` is given the dict, not the node):
    ``dicts`` tells a registration on the caller's node from one on a node of the run's own graph.
    """

    __slots__ = ("dicts", "hooked", "hooks", "is_leaf", "nodes", "requires_grad")

    def __init__(self) -> None:
        self.nodes: dict[int, Any] = {}  # input index -> the caller's node
        # input index -> the caller's tensor's requires_grad, where its stand-in's differs (see Substitute._callers_read)
        self.requires_grad: dict[int, bool] = {}
        # input index -> the caller's tensor's is_leaf, where its stand-in's differs (a non-leaf's stand-in is a leaf)
        self.is_leaf: dict[int, bool] = {}
        self.hooked: set[int] = set()  # inputs whose tensor hooks went to the caller's tensor (see Substitute._callers_hook)
        self.dicts: dict[int, dict[int, Any]] = {}  # id -> a dict of hooks of one of those nodes
        self.hooks: list[tuple[dict[int, Any], int]] = []  # the forward run's registrations there, in order

    def hand_out(self, i: int, node: Any) -> None:
        """Note ``node``, the caller's node of input ``i``, with its dicts of hooks (made if none)."""
        if i in self.nodes:
            return
        self.nodes[i] = node
        was, _active.registering = _active.registering, True
        try:
            for register in (node.register_prehook, node.register_hook):
                handle = register(no_hook)
                hooks = handle.hooks_dict_ref()
                handle.remove()
                if hooks is not None:
                    self.dicts[id(hooks)] = hooks
        finally:
            _active.registering = was

    def registered(self, hooks: Any, handle: Any) -> None:
        """The forward run registered a hook on a caller's node, in ``hooks`` with ``handle``."""
        self.hooks.append((hooks, handle.id))

    def registered_again(self, run: Substitute) -> RemovableHandle:
        """A recomputation registers the hook the forward run did: a handle to that one."""
        n, run.callers_hooks_seen = run.callers_hooks_seen, run.callers_hooks_seen + 1
        if n >= len(self.hooks):
            raise CheckpointError(
                f"remat({run.name}): the recomputation registered more hooks on the caller's tensors it gets as "
                "inputs or on their autograd nodes (x.grad_fn.register_hook, register_prehook; a module's parameter's "
                "register_hook under torch.func.grad) than the forward pass did; a hook there is registered once, "
                "at the forward pass. Register the same hooks in every run of the function."
            )
        hooks, key = self.hooks[n]
        handle = RemovableHandle(hooks)
        handle.id = key
        return handle


class _RemovingTheFollowed(RemovableHandle):
    """The handle ``register_hook`` gives the function in a recomputation, for a hook that follows
    the forward run's handle (see :func:`_register_followed_hook`): removed in a backward pass that
    records no graph (the hook removing itself when it first runs), it removes the hook for good,
    from the forward run's dicts of hooks too, as without remat there is one hook, and one removal:
    a second backward pass through the same graph (``retain_graph=True``) recomputes, and without
    this ran the hook again, where without remat it does not. (Not where the backward pass records
    a graph, ``create_graph=True``, or is itself remat'd (see :func:`replayable_backward`): differentiating
    it recomputes that backward, which must run the hook again as it did.)"""

    followed: Handles = ()  # (a copy of the handle, which pickling makes without it, removes its own hook only)

    def remove(self) -> None:
        super().remove()
        if not torch.is_grad_enabled() and not _active.replayable_backward:
            for hooks, key in self.followed:
                hooks.pop(key, None)


def replayable_backward(entering: bool) -> None:
    """Enter (``entering``) or leave a backward pass that a later differentiation recomputes (a
    remat'd vjp, differentiated again): a hook removing itself there must run again when it is
    recomputed (see :class:`_RemovingTheFollowed`)."""
    _active.replayable_backward += 1 if entering else -1


def nested_run(depth: int) -> bool:
    """Is funckpt's own work, or a run nested in the one whose substitutions were ``depth`` deep, on now?"""
    return _active.internal or len(_active.substitutes) != depth


def substitution_depth() -> int:
    """How many runs' substitutions are on, on this thread."""
    return len(_active.substitutes)


def made_by_nested_region(outputs: Sequence[Any], inputs: Sequence[Any] = ()) -> None:
    """Count the tensors a nested region's Function returned as made by the runs we are inside.

    ``autograd.Function.apply`` does not pass through torch-function modes, and the
    region's outputs are its own detached tensors (made in funckpt's own work, which the
    enclosing runs do not count): without this, a nested remat'd call's output that the
    enclosing function keeps outside its call (a forward hook on a remat'd submodule, a
    list) would not be seen escaping the enclosing run, and its gradient would be lost.
    Nothing is counted where the region was applied by funckpt's own work.
    """
    # (No run around: nothing to note, and nothing more to ask, on the common path of a call.)
    if not _active.substitutes or _active.internal or _is_compiling():
        return
    for substitute in _active.substitutes:
        substitute.note_made(outputs, inputs)


def note_nested_node(ctx: Any) -> None:
    """Note the context of a remat'd region's autograd node, made inside the forward runs we are in.

    Under a torch.func transform a forward run records no graph its caller keeps: what it
    records at its own levels goes with them, and what it records below them (grad mode on, as
    the caller's, inside the enclosing Function's forward) is dropped when that Function's
    node takes its outputs. A nested region's node recorded there is never differentiated, yet
    until then it holds the nested region, and through it the tensors of the enclosing run
    that the nested function closes over (its captured inputs): they would look kept outside
    the enclosing call. The run lets go of those regions before it looks for escapes (see
    ``UserRegion.forward_run``). Weakly, so a node dropped earlier is not kept alive.
    """
    if not _active.substitutes or _is_compiling():  # (no run around: the common path of a call)
        return
    for substitute in _active.substitutes:
        if substitute.nested is not None:
            substitute.nested.append(weakref.ref(ctx))


def route_through_enclosing(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Map tensors through the substitutions of the regions we are running inside.

    ``autograd.Function.apply`` does not pass through torch-function modes, so a
    remat nested inside another region's function would otherwise receive the
    outer region's *original* captured tensors instead of its substitutes.

    Only through the substitutions whose modes are on, as the function's own operators
    are. Under torch.func a region nested in another's run is applied through
    ``custom_function_call``, which passes through the enclosing mode: its run happens in
    that mode's handler, where the mode is off, one level below the enclosing run (its
    Function's forward lowered). The enclosing run's substitutes are tensors of that run's
    levels (a run at a vjp or jvp level of its own wraps its inputs there): routed through
    them, a call nested one region deeper would get the wrapper of a level that is not on
    the stack (remat then raises that it belongs to an enclosing transform), where the
    region around it holds the same tensor unwrapped, the very tensor captured (its own
    substitution maps it to itself: nothing to swap).
    """
    on = {id(m) for m in torch_function_modes()} if _active.substitutes else set()
    for substitute in reversed(_active.substitutes):
        if id(substitute) not in on:
            continue
        mapping = substitute.mapping
        reached = substitute.reached_since
        if reached:
            # A tensor the enclosing recomputation's function reaches only since its call (a closure
            # variable rebound), passed on as an argument of the nested call: a use of it, which the
            # mode does not see (Function.apply does not pass through it).
            for t in tensors:
                if id(t) in reached:
                    assert substitute.rebound is not None
                    raise substitute.rebound(t)
        routed = [mapping.get(id(t), t) for t in tensors]
        if any(r is not t for r, t in zip(routed, tensors)):
            substitute.hit = True
        tensors = routed
    return tensors


def enter_unwatched(first_node: int, inputs: Sequence[torch.Tensor]) -> None:
    """A recomputation starts without the substitution mode: :func:`refused_around` is to know where
    it started (``first_node``) and what its inputs are, until :func:`leave_unwatched`. (Two plain
    calls, not a context object: this runs in every recomputation without the mode.)"""
    _active.unwatched.append((first_node, inputs))


def in_a_recomputation() -> bool:
    """Is a recomputation of a region running on this thread (with the substitution mode or without)?"""
    return bool(_active.unwatched) or any(not s.forward for s in _active.substitutes)


def leave_unwatched(*exc: Any) -> None:
    """The recomputation :func:`enter_unwatched` noted has ended (as a context's ``__exit__``)."""
    _active.unwatched.pop()


def _recorded_before(t: torch.Tensor, first_node: int, leaves: bool = True) -> bool:
    """Does ``t``, at one of its levels, require grad as a leaf or through a graph recorded before the
    autograd node ``first_node``: a differentiable tensor computed before a run started?

    Asked of a functorch tensor too, level by level: its level's number alone does not tell it from
    the run's own, where the run is a recomputation at a fresh ``torch.func.vjp`` level that took the
    number of the caller's level, stepped off the stack for its backward pass.
    ``leaves=False``: a leaf does not count (where nothing tells a leaf made in the run from another).
    """
    while True:
        if t.requires_grad:
            node = t.grad_fn
            if (node is None and leaves) or (node is not None and node._sequence_nr() < first_node):
                return True
        if not is_functorch_wrapped(t):
            return False
        t = unwrap_one_level(t)


def refused_around(captured: Captured) -> dict[int, weakref.ref[Substitute] | None]:
    """Of the tensors a nested call reaches beside its arguments, those a run it is nested in would
    refuse if the function used them (see :meth:`Substitute.refuses`), with that run's substitution
    (``None`` where that run has none on: a recomputation without it, or a functorch tensor of a
    level not on the stack here, which nothing routes).

    What a call reaches is not what it reads. A remat'd function nested in another's run (a
    remat'd module's inner remat'd function) may reach, through its closure, a list the code
    around the outer call appends to: in the outer's recomputation it finds tensors there that
    were not there at the call (the outer call's own output, which a forward hook records). Taken
    as inputs of the nested call, they would be given to it although the enclosing run cannot
    route them (a tensor of the caller's transform level, which the recomputation runs below; the
    outer call's own output, whose node is the one being differentiated), and nothing of the
    nested call reads them. So they are left where they are, and a use of one raises as the run
    around would, had the nested function been called inline. Module tensors are left out: their
    places hold the run's own.
    Looked up through the substitutions that are on, as :func:`route_through_enclosing` routes;
    where none is, in the innermost recomputation running without one (:func:`enter_unwatched`),
    whose inputs are all it routes.
    """
    if _is_compiling() or not (_active.substitutes or in_a_run()):
        return {}
    modes = {id(m) for m in torch_function_modes()} if _active.substitutes else set()
    on = [s for s in reversed(_active.substitutes) if id(s) in modes]
    bare = _active.unwatched[-1] if _active.unwatched and not on else None
    held = {id(t) for _, named in captured.modules for t in named.values()} if captured.modules else set()
    refused: dict[int, weakref.ref[Substitute] | None] = {}
    for original in captured.tensors:
        if id(original) in held:
            continue
        t = original
        for substitute in on:
            stand_in = substitute.mapping.get(id(t))
            if stand_in is not None:
                t = stand_in
            elif substitute.refuses(t):
                refused[id(original)] = weakref.ref(substitute)
                break
        else:
            # (Not a leaf: without the mode, a run does not note the tensors it makes, and a leaf the
            # function made itself, ``t.requires_grad_()`` as HF T5 does, is its own, as in a run with
            # the mode; a leaf from outside the run the function reaches would have been captured.)
            if bare is not None and all(t is not x for x in bare[1]) and _recorded_before(t, bare[0], leaves=False):
                refused[id(original)] = None
            elif is_functorch_wrapped(t) and _foreign_level(t):
                refused[id(original)] = None
    return refused


#: nn.init's initializers: each writes the tensor it is given whole, under no_grad, and returns it.
_NN_INIT = frozenset(getattr(torch.nn.init, n) for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_"))

# Factories of uninitialized memory: a run that reads what one returns before writing it whole
# may compute from garbage, so its values are not compared with the recomputation's (see _errors.py).
_UNINITIALIZED = frozenset(
    {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty, torch.Tensor.new_empty_strided}
    # (``x.new(n)``, the legacy constructor; ``resize_``, whose new elements are uninitialized: what
    # they return is followed as a whole, read before it is written whole turns the comparison off)
    | {torch.Tensor.new, torch.Tensor.resize_, torch.Tensor.resize_as_}
    | ({torch.empty_permuted} if hasattr(torch, "empty_permuted") else set())
)
#: What writes its first argument (or ``tensor=``) whole, reading none of its values: an uninitialized
#: tensor written so is set (``torch.empty(n).uniform_()``, a module built inside the function,
#: whose fresh parameters nn.init writes). (An ``out=`` argument is written whole too.)
_WRITES_WHOLE = frozenset(
    [
        getattr(torch.Tensor, n)
        for n in (
            "fill_", "zero_", "copy_", "uniform_", "normal_", "random_", "bernoulli_",
            "exponential_", "geometric_", "cauchy_", "log_normal_",
        )
        if hasattr(torch.Tensor, n)
    ]
) | _NN_INIT  # fmt: skip


_RETAIN_GRAD = torch.Tensor.retain_grad
_CUSTOM_FUNCTION_CALL = custom_function_call
_REGISTER_HOOK = torch.Tensor.register_hook
_POST_ACCUMULATE_HOOK = torch.Tensor.register_post_accumulate_grad_hook
#: A gradient the function takes of its own (``torch.autograd.grad``, ``.backward()``): a forward run
#: asks its region first (see :attr:`Substitute.differentiating`).
_DIFFERENTIATES = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)
#: The torch functions the substitution mode notes (by kind: the set or function above, or
#: ``LAYOUT_DRAWS`` for a dropout whose mask depends on the layout).
_SPECIAL: dict[Any, Any] = {
    **{f: LAYOUT_DRAWS for f in LAYOUT_DRAWS},
    **{f: _UNINITIALIZED for f in _UNINITIALIZED},
    _RETAIN_GRAD: _RETAIN_GRAD,
    _REGISTER_HOOK: _REGISTER_HOOK,
    _POST_ACCUMULATE_HOOK: _POST_ACCUMULATE_HOOK,
    _CUSTOM_FUNCTION_CALL: _CUSTOM_FUNCTION_CALL,
    **{f: _DIFFERENTIATES for f in _DIFFERENTIATES},
}


def _generators_read_by_function_class(cls: type) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a custom ``autograd.Function``'s own code reads by name (its
    ``forward``'s, ``vmap``'s, ``jvp``'s and ``setup_context``'s globals and closure variables).

    Under a torch.func transform, ``Function.apply`` is the ``custom_function_call`` operator, which
    passes through the substitution mode: its forward's operators run in the mode's handler, where
    the mode is off, so a generator only that forward draws from (a module-global one) is not seen
    at its first draw (see :meth:`Substitute.watch_generators`), and its draws would not be replayed
    (a false "did not reproduce", a wrong gradient with the check off). It is told at the call
    instead, from what the Function's code names: its state then is still the call's. (One read
    off an attribute, ``self.cfg.generator``, is not found: passed as an argument, it is.)"""
    if cls.__module__.partition(".")[0] in _LIBRARY_ROOTS:
        return []
    found: list[torch.Generator] = []
    for name in ("forward", "vmap", "jvp", "setup_context"):
        fn = getattr(cls, name, None)
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        fn_globals = getattr(fn, "__globals__", {})
        # (the names it and the functions and lambdas defined inside it load as globals)
        found.extend(v for n in global_names(code) if type(v := fn_globals.get(n)) is _GENERATOR)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            if type(value) is _GENERATOR:
                found.append(value)
    return found


#: What :meth:`Substitute._callers_read` gives where the function reads its stand-in's own.
_NOT_READ = object()


def _funckpts_own_read(frame: types.FrameType) -> bool:
    """Is ``frame``, which read an input's metadata in a run, funckpt's own work (a call nested in
    the run deciding what its inputs require), not the user's code nor a nested run's read of what
    the caller's tensor says (see :meth:`Substitute._callers_read`)? That work must see the stand-in."""
    return frame.f_globals.get("__name__", "").startswith("funckpt.") and frame.f_code.co_name != "_callers_read"


def no_hook(*args: Any) -> None:
    """What a hook the forward run registered leaves in its dict of hooks once the run is over
    (see :class:`FollowingItsHandle`)."""
    return None


#: Where a hook registered again must still be found for it to run (see :class:`FollowingItsHandle`):
#: a forward run's dict of hooks and the hook's key there, for each run it follows.
Handles = tuple[tuple[dict[int, Any], int], ...]


class FollowingItsHandle:
    """A hook that the function registered in a forward run, registered again elsewhere (on the
    caller's tensor, for one on an input; on the recomputed tensor, for one on a tensor the function
    made), still removed by the handle ``register_hook`` gave the function in that forward run
    (``handle.remove()`` between the forward and the backward pass: it then no longer runs, as
    without remat).

    That handle deletes the hook's key from the forward run's dict of hooks, kept here (the tensor
    it was on is dropped), whose entry is :func:`no_hook` meanwhile. ``handles``: each such dict and
    key; more than one where that forward run was itself a recomputation's (a remat'd call nested in
    another), whose registration followed a handle too: all of them must be in place.
    """

    __slots__ = ("handles", "hook")

    def __init__(self, hook: Callable[..., Any], handles: Handles) -> None:
        self.hook, self.handles = hook, handles

    def __call__(self, *args: Any) -> Any:
        for hooks, key in self.handles:
            if key not in hooks:
                return None
        return self.hook(*args)


def _metadata_reads() -> frozenset[Any]:
    """The torch functions that read a tensor's metadata (its shape, dtype, whether it requires
    grad) and compute nothing: they pass no value, and so no gradient, whatever tensor they get."""
    getters = (
        "shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "layout", "_version",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "itemsize",
        "nbytes", "retains_grad", "output_nr",
    )  # fmt: skip
    methods = (
        "size", "dim", "numel", "nelement", "stride", "is_contiguous", "data_ptr", "element_size",
        "is_floating_point", "is_complex", "get_device", "storage_offset", "is_inference",
    )  # fmt: skip
    found = [getattr(torch.Tensor, n).__get__ for n in getters if hasattr(torch.Tensor, n)]
    return frozenset(found + [getattr(torch.Tensor, n) for n in methods if hasattr(torch.Tensor, n)])


#: (A getter's ``__get__`` is a new method-wrapper at each access, equal to the others: found by a set.)
_METADATA = _metadata_reads()
_GRAD_FN = cast(Any, torch.Tensor.grad_fn).__get__
_REQUIRES_GRAD = cast(Any, torch.Tensor.requires_grad).__get__
_IS_LEAF = cast(Any, torch.Tensor.is_leaf).__get__
#: Operators whose result passes no gradient back to their input: a foreign tensor may go in.
#: Besides ``detach``, the reads of a tensor's values as Python numbers or text (``loss.item()``,
#: ``float(t)``, ``f"{t:.3f}"``, a log line of the previous step's auxiliary loss).
_CUTS_GRADIENT = frozenset(
    [torch.Tensor.detach, torch.detach, cast(Any, torch.Tensor.data).__get__]  # (h.data: detached, an old logging idiom)
    # What autograd gives a zero derivative (sign, round, floor, ceil, trunc) or none (histc, floor_divide):
    + [getattr(m, n) for m in (torch, torch.Tensor) for n in ("sign", "round", "floor", "ceil", "trunc", "fix", "floor_divide", "histc") if hasattr(m, n)]
    + [
        getattr(torch.Tensor, n)
        for n in ("item", "tolist", "__float__", "__int__", "__bool__", "__complex__", "__index__", "__format__", "__repr__")
        if hasattr(torch.Tensor, n)
    ]
    # nn.init's initializers, which write under no_grad (a module built inside the function):
    + list(_NN_INIT)
)

#: Of those, the reads of a tensor's values as Python numbers or text: a recomputation may make them
#: of a functorch tensor it reached only since the call (a log line of the previous step's loss,
#: which the caller appended under grad to a list the function reaches), where it refuses any other
#: use of one. (A plain tensor reached since is a leaf, a closure variable rebound: refused.)
_READS_AS_PYTHON = frozenset(
    getattr(torch.Tensor, n)
    for n in ("item", "tolist", "__float__", "__int__", "__bool__", "__complex__", "__index__", "__format__", "__repr__")
    if hasattr(torch.Tensor, n)
)

_is_compiling = torch.compiler.is_compiling  # (Dynamo reads it as True where it traces)


def _writes_its_first_argument(func: Any) -> bool:
    """Does ``func`` write into its first argument (``add_``, ``copy_``, ``x[i] = v``, ``x += v``)?"""
    written = _WRITES_FIRST.get(func)
    if written is None:
        name = getattr(func, "__name__", "")
        written = _WRITES_FIRST[func] = name == "__setitem__" or (
            name.endswith("__") and name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))
        )
    return written


_WRITES_FIRST: dict[Any, bool] = {}


def _makes_values_anew(func: Any) -> bool:
    """Does ``func`` read only its tensor arguments' shape, dtype and device, or draw values no
    derivative flows through (``randn_like``, ``new_zeros``, ``bernoulli``)?"""
    anew = _ANEW.get(func)
    if anew is None:
        name = getattr(func, "__name__", "")
        anew = _ANEW[func] = name.endswith("_like") or name.startswith("new_") or name in ("bernoulli", "bernoulli_", "multinomial")
    return anew


_ANEW: dict[Any, bool] = {}


def _root(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``t``'s functorch wrappers, or the tensor that one views."""
    b = bottom(t)
    return b if b._base is None else b._base


class Taint:
    """The tensors a forward run made that a derivative of its differentiable inputs flows through.

    Where the forward run records no graph it can see (below a ``vmap`` around the
    caller's grad level with a saving policy, ``vmap(grad(f))``, ``grad(vmap(f))``;
    below ``vmap(jvp(f))``; a checkpointed loop's forward sweep), a tensor it computes
    from its differentiable inputs and keeps outside the call (a key/value cache, a
    forward hook's list, an auxiliary loss) cannot be told from a constant by
    ``requires_grad``: it is told by this, spread operator by operator from the inputs
    (``seeds``) to what each operator returns or writes. ``any_grad_mode``: spread under
    ``no_grad`` too (a forward-mode derivative flows there, and a loop's sweep runs under it).
    A transform the run calls itself (``torch.func.grad`` inside) returns tensors this never sees.
    """

    __slots__ = ("any_grad_mode", "ids", "roots", "seeds")

    def __init__(self, seeds: Iterable[torch.Tensor], any_grad_mode: bool) -> None:
        self.seeds = frozenset(id(t) for t in seeds)
        # (By id, each with its tensor: a tensor made where this does not see it, by torch.from_numpy
        # or a torch.func transform inside the run, may take the id of a dead one that carried a
        # derivative, and must not inherit it.)
        self.ids: dict[int, weakref.ref[torch.Tensor]] = {}
        # The tensors written with what carries a derivative, by the plain tensor under any functorch
        # wrappers that they view (or are): a write into a view (``buf[0].copy_(k)``, a static
        # cache's ``index_copy_`` into a slice) reaches its base and every other view of it, not
        # what was detached from it.
        self.roots: dict[int, weakref.ref[torch.Tensor]] = {}
        self.any_grad_mode = any_grad_mode

    def _carried(self, value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            r = self.ids.get(id(value))
            return (r is not None and r() is value) or id(value) in self.seeds
        if isinstance(value, (list, tuple)):
            return any(self._carried(v) for v in value)
        return False

    def spread(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], outs: Sequence[Any]) -> None:
        """Note what ``func`` returned (every tensor made here passes through this: an id
        reused after its tensor died is noted afresh) and, if it carries a derivative, what it wrote."""
        carries = (
            func not in _CUTS_GRADIENT
            and not _makes_values_anew(func)
            and (self.any_grad_mode or torch.is_grad_enabled())
            and (self._carried(args) or self._carried(list(kwargs.values())))
        )
        ids = self.ids
        for o in outs:
            if isinstance(o, torch.Tensor):
                if carries and has_gradient_dtype(o):
                    ids[id(o)] = weakref.ref(o)
                else:
                    ids.pop(id(o), None)
        if not carries:
            return
        written = [kwargs.get("out")]
        if args and _writes_its_first_argument(func):
            written.append(args[0])
        for w in written:
            for t in w if isinstance(w, (list, tuple)) else (w,):
                if isinstance(t, torch.Tensor) and has_gradient_dtype(t):
                    ids[id(t)] = weakref.ref(t)
                    root = _root(t)
                    self.roots[id(root)] = weakref.ref(root)

    def holds(self, t: torch.Tensor) -> bool:
        """Does ``t`` carry a derivative: made from one, or a view of what was written with one?"""
        r = self.ids.get(id(t))
        if r is not None and r() is t:
            return True
        if not self.roots:
            return False
        root = _root(t)
        r = self.roots.get(id(root))
        return r is not None and r() is root

    def escaped(self, made: Sequence[weakref.ref[torch.Tensor]], returned: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors among ``made`` still alive and carrying a derivative, but for ``returned``
        (the outputs, the inputs) and what those view (a view's ``_base``: the tensor at the root)."""
        known = {id(b) for t in returned for b in (t, t._base) if b is not None}
        return [u for r in made if (u := r()) is not None and id(u) not in known and self.holds(u)]


class Substitute(OnThreadStack, TorchFunctionMode):
    """Replaces captured tensors by identity; optionally rejects foreign tensors.

    ``mapping`` maps ``id(original)`` to the tensor to use instead. Any other
    tensor argument that is foreign (see the module docstring), neither one of
    the region's ``inputs`` nor produced inside the region, raises
    :class:`CheckpointError`. ``forward`` tells the forward run (under no-grad)
    from a recomputation.
    """

    #: Did a hook get registered (a tensor's, an autograd node's) while this forward run was on, by
    #: its function or a call nested in it? See UserRegion.registers_hooks_when_recomputed.
    any_hooks = False

    def __init__(
        self,
        mapping: dict[int, torch.Tensor],
        inputs: tuple[torch.Tensor, ...],
        forward: bool,
        name: str,
        first_node: int,
        watch: WriteWatch | None = None,
    ) -> None:
        super().__init__()
        self.mapping = mapping
        # Snapshots inputs before the run writes them (see WriteWatch.call): where one is set,
        # this mode stands in for the dispatch mode that would watch every operator.
        self.watch = watch
        self.forward = forward
        self.name = name
        self.inside: set[int] = set()  # ids of the tensors made inside this run (alive or not)
        self.known = {id(t) for t in inputs}
        self.inputs = inputs
        self.first_node = first_node
        self.uninitialized = False  # did the run read memory it allocated uninitialized, before writing it?
        # The storages of what the run allocated uninitialized and has not written whole yet (by
        # storage, not tensor: an alias torch makes unseen, ``nn.Parameter(torch.empty(n))``, reads
        # the same memory), weakly, with their sizes in bytes.
        self.unset: dict[int, tuple[StorageWeakRef, int]] = {}
        # Every storage the run allocated uninitialized, written since or not (weakly, by storage):
        # where a Parameter the run made sits (see _made_on_memory_it_allocated).
        self.allocated: dict[int, StorageWeakRef] = {}
        self.used: set[int] = set()  # ids of the inputs passed to a torch function during the run
        # The tensors the run made, weakly, at their positions among every tensor its operators
        # returned (the forward run under plain autograd only): any still alive and requiring
        # grad once the run's local graph is dropped escaped it.
        self.made: list[weakref.ref[torch.Tensor]] | None = None
        # Did a nested region's outputs take positions in ``made``? (Below a vmap, a recomputation of
        # such a region notes them otherwise: positions there are not the forward run's.)
        self.made_nested = False
        # In a recomputation, the positions of the tensors that escaped the forward run, and
        # the tensors made there (see UserRegion._escaped_tensors): they are outputs too.
        self.keep: dict[int, torch.Tensor | None] | None = None
        self.count = 0  # tensors the operators returned so far (a recomputation's, while keep is set)
        # Did the run receive a captured tensor itself, not through a module's place (where
        # reparametrization put its substitute already)? A recomputation needs this mode only if so.
        self.hit = False
        # Ids of the inputs the run called ``retain_grad()`` on: a local leaf in the forward
        # run, where it does nothing; the caller's tensor is the one to retain its grad.
        self.retained: set[int] = set()
        # The hooks the run registered on tensors it made (``h.register_hook(...)``), in order (see
        # _register_followed_hook): in the forward run, each one's dict of hooks and key (and the
        # handles its registration followed itself, where that run is a recomputation's); in a
        # recomputation, those the forward run noted. (Not on its inputs: see _move_input_hooks.)
        self.hooks: list[tuple[dict[int, Any] | None, int, Handles]] | None = [] if forward else None
        self.hooks_seen = 0  # (a recomputation's count of them so far)
        # Did the run call a dropout whose mask depends on its input's layout (see ``_draws``)?
        self.layout_draws = False
        # Where a forward run records no graph it can see: what carries a derivative (see Taint).
        self.taint: Taint | None = None
        # The forward run's last calls that a tail may hold (index, function, arguments, result),
        # and how many calls it made, metadata reads aside (see _tail); None where not noted.
        # (At most TRAIL_LENGTH of them: what the run made is not held on for longer.)
        self.trail: collections.deque[tuple[int, Any, tuple[Any, ...], Any]] | None = None
        self.calls = 0
        # The contexts of the autograd nodes of the regions applied inside this forward run, weakly,
        # where the run records no graph its caller keeps (see note_nested_node); None where not noted.
        self.nested: list[weakref.ref[Any]] | None = None
        # A recomputation's: the differentiable tensors the function reaches now and did not at the
        # call (see changed_captures), and the error a use of one raises (see reached_since_the_call).
        # (By id, the tensor to name: a module's tensor where its stand-in is used, see reached_since_the_call.)
        self.reached_since: dict[int, torch.Tensor] = _NONE_REACHED
        self.rebound: Callable[[torch.Tensor], CheckpointError] | None = None
        # The tensors the call reaches that a run around it would refuse, left to that run's
        # substitution (see refused_around), by id.
        self.refused: dict[int, weakref.ref[Substitute] | None] = {}
        # A forward run that replays random numbers: the ids of the generators its region replays,
        # and what to tell it of another one its function draws from (see watch_generators).
        self.generator_ids: set[int] | None = None
        self.generator_found: Callable[[torch.Generator], None] | None = None
        # A forward run's: the caller's tensors, by the position of ``inputs`` each stands in for,
        # where they may have nodes of their own (plain autograd). Any run's: the nodes of those the
        # function read, and the hooks registered there (see CallersNodes); a recomputation's count.
        self.given: Sequence[torch.Tensor] | None = None
        # Did the run register a hook (a tensor hook, a post-accumulate-grad hook) on a leaf it made
        # itself that requires grad (``z = torch.zeros(3, requires_grad=True)``)? See funckpt._autograd.vjp.
        self.own_leaf_hooks = False
        self.callers_nodes: CallersNodes | None = None
        self.callers_hooks_seen = 0
        # A forward run's region and the tensors its Function got, where the run's inputs are stand-ins
        # for the caller's tensors: the region is asked before the function takes a gradient of its own
        # (a torch function in ``_DIFFERENTIATES``: see UserRegion.refuse_missed_paths); None elsewhere.
        self.differentiating: tuple[Any, Sequence[torch.Tensor]] | None = None

    def watch_generators(self, known: Iterable[torch.Generator], found: Callable[[torch.Generator], None]) -> None:
        """Have this forward run tell ``found`` of each ``torch.Generator`` its function passes to a
        torch function, other than ``known`` (those its region replays already), before the first draw.

        The walk of the call's closure and modules finds most generators (:func:`find_captured`),
        not every one: one held by a module inside a plain object, a list or a dict of its own, or
        read off a class attribute (``self.cfg.generator``, ``Config.generator``). Its draws would
        not be replayed: the recomputation would draw other numbers (a false "did not reproduce",
        a silently wrong gradient with the check off) and advance the caller's generator. Its state
        before the run's first draw from it is the state at the call: nothing the run's torch
        functions did drew from it before. The runs this one is nested in are told too: each
        recomputation of theirs runs this call's function again, from their replayed state.
        """
        self.generator_ids = {id(g) for g in known}
        self.generator_found = found

    def _note_generator(self, g: torch.Generator) -> None:
        """``g`` is passed to a torch function in this run (see :meth:`watch_generators`)."""
        for substitute in (*_active.substitutes, self):
            ids = substitute.generator_ids
            if ids is not None and id(g) not in ids:
                ids.add(id(g))
                assert substitute.generator_found is not None
                substitute.generator_found(g)

    def _thread_stack(self) -> list[Any]:
        return _active.substitutes

    def _stack_item(self) -> Any:
        return self

    def _swap(self, value: Any, used: set[int] | None, check: bool = True) -> Any:
        """``value`` with captured tensors replaced; the inputs it passes are added to ``used``.
        ``check``: are the others checked (:meth:`_check`; not for what :data:`_CUTS_GRADIENT` takes)?
        Those reached only since the call are checked even so: the reads :data:`_READS_AS_PYTHON`
        leaves to the determinism check take a tensor alone, never in a list or keyword."""
        if isinstance(value, torch.Tensor):
            key = id(value)
            replacement = self.mapping.get(key)
            if replacement is not None:
                if self.reached_since and key in self.reached_since:
                    self._check(value)  # (reached at the call, now where another one was: see changed_captures)
                self.hit = True
                if used is not None:
                    used.add(id(replacement))
                return replacement
            if key in self.known:
                if self.reached_since and key in self.reached_since:
                    self._check(value)  # (a moved module's tensor, through its place)
                if used is not None:
                    used.add(key)
            elif key not in self.inside and (check or key in self.reached_since):
                self._check(value)  # (a tensor reached only since the call: refused even detached)
            return value
        if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
            swapped = [self._swap(v, used, check) for v in value]
            return type(value)(swapped) if isinstance(value, list) else tuple(swapped)
        return value

    def note_made(self, outputs: Sequence[Any], inputs: Sequence[Any] = ()) -> None:
        """``outputs`` were made in this run by the user's code, by an operator or a nested region
        (see :func:`made_by_nested_region`, which gives its ``inputs``): they take positions
        (``made`` in a forward run, ``keep`` in a recomputation)."""
        inside, made, keep = self.inside, self.made, self.keep
        self.trail = None  # (a nested region's work is not this run's to skip)
        if self.taint is not None:
            self.taint.spread(None, inputs, {}, outputs)
        if made is not None:  # a forward run: a tensor's position is its index in ``made``
            self.made_nested = True
            for o in outputs:
                if isinstance(o, torch.Tensor):
                    inside.add(id(o))
                    made.append(weakref.ref(o))  # (an autograd.Function's: requires grad once it returns)
        elif keep is not None:  # a recomputation: keep those at the escaped positions
            for o in outputs:
                if isinstance(o, torch.Tensor):
                    inside.add(id(o))
                    if self.count in keep:
                        keep[self.count] = o
                    self.count += 1
        else:
            for o in outputs:
                if isinstance(o, torch.Tensor):
                    inside.add(id(o))

    def reached_since_the_call(
        self, tensors: Sequence[torch.Tensor], rebound: Callable[[torch.Tensor], CheckpointError]
    ) -> None:
        """A recomputation's function reaches ``tensors`` and did not at the call (:func:`changed_captures`):
        a use of one raises ``rebound(t)`` (a closure variable rebound to another tensor since).

        Reached is not read: what the code around the call appended to a list the function
        reaches (the call's own output, which a forward hook records) is no rebinding while the
        function does not use it, and without remat it gets no gradient from the function either.
        """
        reached = {id(t): t for t in tensors}
        for key in getattr(tensors, "of_modules", ()):
            # A module moved where another one sat: the function reads its tensors through its places,
            # where the reparametrization put their stand-ins.
            stand_in = self.mapping.get(key)
            if stand_in is not None:
                reached[id(stand_in)] = reached[key]
        self.reached_since = reached
        self.rebound = rebound

    def refuses(self, t: torch.Tensor) -> bool:
        """Would this run refuse ``t`` (:meth:`_check`) if the function used it?"""
        key = id(t)
        if key in self.mapping or key in self.known or key in self.inside:
            return False
        if key in self.reached_since or key in self.refused:
            return True
        return (self._foreign(t) or _recorded_before(t, self.first_node)) and not self._made_on_an_input(t)

    def _foreign(self, t: torch.Tensor) -> bool:
        """Is ``t`` foreign to this run (see the module docstring)? functorch tensors are judged
        by their level alone: fn may use torch.func inside. A plain tensor is foreign if it
        requires grad and was not made inside this run: a leaf, or the result of an autograd
        node created before the run started (autograd numbers nodes in creation order)."""
        if is_functorch_wrapped(t):
            return _foreign_level(t)
        node = t.grad_fn
        return (t.requires_grad and (node is None or node._sequence_nr() < self.first_node)) or has_tangent(t)

    def _made_on_an_input(self, t: torch.Tensor) -> bool:
        """A Parameter the function made itself on an input's memory, where no mode sees it made (peft's
        transpose() for GPT-2's Conv1D: nn.Parameter(weight.T)): a gradient into it reaches no input,
        without remat either. (A stand-in for an input, also a leaf on its memory, is a plain tensor.)"""
        return type(t) is torch.nn.Parameter and t.grad_fn is None and not has_tangent(t) and self._on_an_inputs_memory(t)

    def _made_on_memory_it_allocated(self, t: torch.Tensor) -> bool:
        """A Parameter the function made itself, on memory this run allocated (``torch.empty``, from
        which every ``torch.nn`` layer makes its parameters: a module built inside the function,
        ``nn.Linear(4, 4)(x)``). ``nn.Parameter`` makes it where no mode sees it made; its gradient
        stays inside the function, without remat too, as under ``torch.utils.checkpoint``. (One on
        memory the run did not allocate, ``nn.Parameter(torch.randn(n))``, is still refused: telling
        it from a foreign tensor would need the memory of every tensor the run made.)"""
        if not self.allocated or type(t) is not torch.nn.Parameter or t.grad_fn is not None or has_tangent(t):
            return False
        key = storage_of(t)
        ref = self.allocated.get(key) if key is not None else None
        return ref is not None and not storage_expired(ref)  # (alive: the very storage t sits on)

    def _check(self, t: torch.Tensor) -> None:
        key = id(t)
        if self.reached_since and key in self.reached_since:
            assert self.rebound is not None
            raise self.rebound(self.reached_since[key])
        refused = bool(self.refused) and key in self.refused
        if refused:
            ref = self.refused[key]
            around = ref() if ref is not None else None
            if around is not None:
                around._check(t)  # (raises as the run around would, had the nested call not been there)
        wrapped = is_functorch_wrapped(t)
        foreign = refused or self._foreign(t)
        if foreign and not wrapped and id(t) in _placed_by_other_threads():
            raise CheckpointError(
                f"remat({self.name}): the function read another thread's stand-in for a module's "
                f"tensor (shape {tuple(t.shape)}): {_SAME_MODULE_IN_TWO_THREADS}"
            )
        if foreign and not refused and (self._made_on_an_input(t) or self._made_on_memory_it_allocated(t)):
            self.inside.add(id(t))  # (the run's own from now on)
            return
        if foreign and not wrapped and spent_escape(t):
            raise CheckpointError(
                f"remat({self.name}): the function used a tensor of shape {tuple(t.shape)} that an earlier "
                "remat'd call computed and kept outside itself (a module attribute, a list, a global) and whose "
                "backward pass has run since: its graph is freed, and without remat a backward through it "
                "would raise 'Trying to backward through the graph a second time'. Detach it where it is kept "
                "if it is state, or compute it again before reading it."
            )
        if foreign and (type(t.grad_fn).__name__ == "_RematFunctionBackward" if not wrapped else hasattr(t, PUT_BACK)):
            raise CheckpointError(
                f"remat({self.name}): the function used a tensor of shape {tuple(t.shape)} that a remat'd "
                "call computed earlier and that was kept outside that call (a transformer's key/value "
                "cache, which HF models fill unless called with use_cache=False; a cache a module fills on "
                "its first call, such as timm LeViT's attention_bias_cache in eval mode; or a value stored "
                "on a module); a recomputation reads it where the forward pass computed it. remat cannot "
                "route its gradient here, and it would silently be missing. Call the model with "
                "use_cache=False when training, empty such a cache before each forward pass (or do not "
                "cache under remat), or keep the value as a parameter or buffer of the module, which "
                "remat routes."
            )
        if foreign:
            raise CheckpointError(
                f"remat({self.name}): the function used a tensor of shape {tuple(t.shape)} and dtype "
                f"{t.dtype} that {'belongs to an enclosing torch.func transform' if wrapped else 'requires grad or carries a forward-mode tangent'}"
                " but is neither an argument nor reachable through the function's closure, its "
                "functools.partial arguments, the globals its code names (and their attributes, of "
                "a Python module of yours), or the parameters and "
                "buffers of an nn.Module it is bound to, as they were when the call was made (one "
                "appended since to a list the function reaches, as a forward hook or the caller "
                "logging outputs does, is not). remat cannot route a gradient to it, and it would "
                "silently be zero or missing. Pass the tensor to the remat'd function as an argument "
                "(or make it a parameter or buffer of the module you remat), or detach it where it "
                "is logged."
            )

    def _on_an_inputs_memory(self, t: torch.Tensor) -> bool:
        """Does ``t`` share its storage with one of the run's inputs (or what stands for a captured tensor)?"""
        key = storage_of(t)
        return key is not None and any(storage_of(x) == key for x in (*self.inputs, *self.mapping.values()))

    def _layout_draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
        """A dropout whose mask depends on its input's layout: noted (a recomputation without this
        mode then redraws its dropouts too), and computed as at the call where the kernel in force
        here differs from the call's (see ``_draws``): the call to make instead, if so."""
        draw = layout_draw(func, args, kwargs)
        if draw is None:
            return None
        self.layout_draws = True
        return redrawn(draw)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # This runs for every operator of a forward run. Its common case there (every tensor an
        # input or made inside, none to swap, nothing to trace, no function noted here) runs
        # first, with nothing else to ask: it hands anything else to the general case. (A write
        # watch, on where an input is not differentiable, as a transformer layer's mask, is asked
        # as there.)
        # (Never while Dynamo inlines this handler: the general case below says why.)
        if not _is_compiling():
            if func in _METADATA:  # (x.shape, x.requires_grad: of any tensor, foreign or not)
                mapping = self.mapping
                if mapping and args and id(args[0]) in mapping:
                    self.hit = True
                    args = (mapping[id(args[0])], *args[1:])
                if (
                    (self.given is not None or self.callers_nodes is not None)
                    and args
                    and (func == _GRAD_FN or func == _REQUIRES_GRAD or func == _IS_LEAF)
                ):
                    # (An input's x.grad_fn, x.requires_grad, x.is_leaf: the caller's tensor's, as without remat.)
                    read = self._callers_read(func, args[0])
                    if read is not _NOT_READ:
                        return read
                return func(*args, **kwargs) if kwargs else func(*args)
            made = self.made
            if (
                made is not None
                and self.taint is None
                and not self.unset
                and func not in _SPECIAL
                and self._plain(args)
                and (not kwargs or self._plain(kwargs.values()))
            ):
                watch = self.watch
                if watch is not None and may_write(func, kwargs) and not _active.internal:
                    out = watch.call(func, args, kwargs or {})
                else:
                    out = func(*args, **kwargs) if kwargs else func(*args)
                internal = _active.internal  # (asked once the operator ran: a nested region's work sets it)
                trail = self.trail
                if trail is not None:  # (see _tail: the calls the run ends with)
                    self.calls += 1
                    if func in TAIL and not kwargs and not internal:
                        trail.append((self.calls - 1, func, args, out))
                    elif trail:
                        trail.clear()
                if type(out) is torch.Tensor and not internal:  # (the common case of _note_made_here, inline)
                    self.inside.add(id(out))
                    made.append(weakref.ref(out))
                    return out
                return self._note_made_here(out, made)
        # Any other call: the common case (no captured tensor to swap, every tensor known or made
        # inside) builds nothing. (Here, not in a method of its own: torch 2.11's Dynamo, tracing
        # this handler where a compiled function runs inside remat, fails a guard on the call.)
        # Usage and escapes are not recorded while Dynamo inlines this handler (a compiled
        # function called inside remat): it cannot trace the mutation of these collections.
        mapping, known, inside = self.mapping, self.known, self.inside
        compiling = _is_compiling()
        used = None if compiling else self.used
        swapped: list[Any] | None = None
        for i, a in enumerate(args):  # _swap, with its tensor case inline
            if isinstance(a, torch.Tensor):
                key = id(a)
                replacement = mapping.get(key) if mapping else None
                if replacement is not None:
                    if (
                        self.reached_since
                        and key in self.reached_since
                        and (func not in _READS_AS_PYTHON or not is_functorch_wrapped(a))
                    ):
                        self._check(a)  # (reached at the call, now where another one was: see changed_captures)
                    self.hit = True
                    if used is not None:
                        used.add(id(replacement))
                    if swapped is None:
                        swapped = list(args)
                    swapped[i] = replacement
                elif key in known:
                    if self.reached_since and key in self.reached_since:
                        self._check(a)  # (a moved module's tensor, through its place: see reached_since_the_call)
                    if used is not None:
                        used.add(key)
                elif key not in inside and (
                    func not in _CUTS_GRADIENT
                    or (key in self.reached_since and (func not in _READS_AS_PYTHON or not is_functorch_wrapped(a)))
                ):
                    # (A tensor reached only since the call is refused even where it is read detached:
                    # the recomputation would compute with the new value, which without remat the
                    # function never saw, where the forward run read the old one: a straight-through
                    # estimator's gradient, or any gradient where the determinism check is off.)
                    self._check(a)
            elif isinstance(a, (list, tuple)) and a:
                b = self._swap(a, used, func not in _CUTS_GRADIENT)
                if b is not a:
                    if swapped is None:
                        swapped = list(args)
                    swapped[i] = b
            elif type(a) is _GENERATOR and self.generator_ids is not None and not compiling:
                self._note_generator(a)  # (one given positionally: torch.poisson(x, g))
        if kwargs:
            generator = kwargs.get("generator")
            if type(generator) is _GENERATOR and self.generator_ids is not None and not compiling:
                self._note_generator(generator)
            for v in kwargs.values():
                if isinstance(v, (torch.Tensor, list, tuple)):  # else nothing to swap or check
                    check = func not in _CUTS_GRADIENT
                    kwargs = {k: self._swap(v, used, check) for k, v in kwargs.items()}
                    break
        if self.unset and not compiling:
            self._note_reads(func, args if swapped is None else swapped, kwargs or {})
        redraw = None
        special = _SPECIAL.get(func)  # (one lookup for the few functions noted here)
        if special is None:
            pass
        elif special is _UNINITIALIZED:
            if compiling:  # (where Dynamo traces this handler, no tensor is followed)
                self.uninitialized = True
        elif special is _CUSTOM_FUNCTION_CALL:
            if self.generator_ids is not None and not compiling and args and isinstance(args[0], type):
                for g in _generators_read_by_function_class(args[0]):
                    self._note_generator(g)
        elif special is _RETAIN_GRAD:
            if args and id(args[0]) in known:
                self.retained.add(id(args[0]))
        elif special is _REGISTER_HOOK or special is _POST_ACCUMULATE_HOOK:
            _note_hooks()
            if args and id(args[0]) in inside and id(args[0]) not in known and args[0].is_leaf and args[0].requires_grad:
                self.own_leaf_hooks = True  # (a leaf the function made: see own_leaf_hooks)
            if (self.given is not None or self.callers_nodes is not None) and args and not compiling:
                given = args if swapped is None else swapped
                handle = self._callers_hook(func, given[0], tuple(given[1:]), kwargs or {})
                if handle is not None:
                    return handle
            if (
                special is _REGISTER_HOOK
                and not _active.registering
                and not compiling
                and args
                and id(args[0]) in inside
                and id(args[0]) not in known
                and (self.hooks is not None or any(s.hooks is not None for s in _active.substitutes))
            ):
                if self.trail is not None:  # (as for any other call: see the end of this handler)
                    self.calls += 1
                    self.trail.clear()
                runs = _active.substitutes
                among = None if all(id(args[0]) not in r.known for r in runs) else [r for r in runs if id(args[0]) not in r.known]
                return _register_followed_hook(func, args if swapped is None else tuple(swapped), kwargs or {}, among)
        elif special is _DIFFERENTIATES:
            if self.differentiating is not None and not compiling and not _active.internal:
                region, callers = self.differentiating
                narrowed = region.refuse_missed_paths(self.inputs, callers, func, args if swapped is None else tuple(swapped), kwargs or {})
                if narrowed is not None:  # (a gradient whose missed paths are checked to add nothing)
                    func = narrowed
        elif not compiling:  # a dropout (LAYOUT_DRAWS)
            redraw = self._layout_draw(func, args if swapped is None else tuple(swapped), kwargs or {})
        watch = self.watch
        # (funckpt's own work for a region nested in this run, such as reading its inputs'
        # storages, writes none of them: only the user's code is watched.)
        if watch is not None and not compiling and not _active.internal and may_write(func, kwargs):
            out = watch.call(func, args if swapped is None else tuple(swapped), kwargs or {}, redraw)
        elif redraw is not None:
            out = redraw()
        else:
            out = func(*(args if swapped is None else swapped), **(kwargs or {}))
        if special is _UNINITIALIZED and not compiling and not _active.internal and isinstance(out, torch.Tensor):
            # (read before it is written whole: see _note_reads; with no elements, it holds no garbage,
            # and followed, it would keep the common case's path off for the rest of the run)
            if out.numel() and not out.is_meta:
                self._follow_unset(out)
        # Every tensor made here is the run's own, whatever it becomes later: a leaf
        # made inside and then set to require grad (as HF T5 does) is not foreign.
        # (One loop for a tensor and a tuple alike: on torch 2.11, Dynamo tracing this handler
        # guards id(out) taken directly on the output's source, a fresh tensor, and fails.)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if func in _CUTS_GRADIENT and not compiling and isinstance(out, torch.Tensor):
            given = args if swapped is None else swapped
            if any(out is a for a in (*given, *(kwargs or {}).values())) and id(out) not in inside:
                # nn.init returns the tensor it wrote, made elsewhere: a foreign one stays foreign
                # (its use is refused as such, not as a leaf the function made).
                outs = ()
        made = self.made
        if compiling or _active.internal:  # (inline where Dynamo traces this: torch 2.11 fails on the call)
            for o in outs:
                if isinstance(o, torch.Tensor):
                    inside.add(id(o))
        elif made is not None:  # (note_made's forward run, inline: this runs for every operator)
            for o in outs:
                if isinstance(o, torch.Tensor):
                    inside.add(id(o))
                    made.append(weakref.ref(o))
            if self.taint is not None:
                self.taint.spread(func, args if swapped is None else swapped, kwargs or {}, outs)
        else:
            self.note_made(outs)
        trail = self.trail
        if trail is not None:  # (as in the common case: a call whose captured tensors were swapped)
            self.calls += 1
            if func in TAIL and not kwargs and special is None and not compiling and not _active.internal:
                trail.append((self.calls - 1, func, args if swapped is None else tuple(swapped), out))
            elif trail:
                trail.clear()
        return out

    def _callers_read(self, func: Any, t: Any, delegated: bool = False) -> Any:
        """What ``func`` (``grad_fn``'s, ``requires_grad``'s or ``is_leaf``'s getter) reads of the caller's tensor that
        ``t``, an input's stand-in, stands in for, where it differs from what it reads of ``t``:
        the forward run's (``given``), noted for the recomputation (see :class:`CallersNodes`);
        :data:`_NOT_READ` where it does not differ (or ``t`` is no input's stand-in).

        A parameter of a module the function reaches says it requires grad without remat under
        ``torch.func.grad``, and its stand-in, at the forward run's own grad level, that it does not:
        code summing a penalty over ``p for p in m.parameters() if p.requires_grad`` computed another
        value. And an input's ``grad_fn`` is the caller's node (see :class:`CallersNodes`)."""
        i = next((k for k, s in enumerate(self.inputs) if s is t), None)
        if i is None or (not delegated and _funckpts_own_read(sys._getframe(2))):
            return _NOT_READ
        grad_fn, is_leaf = func == _GRAD_FN, func == _IS_LEAF
        if self.given is not None:  # (a forward run)
            caller = self.given[i]
            if caller is t:
                return _NOT_READ
            # (The stand-in of a run this one is nested in: what that run gives for it.)
            value = self._enclosing_read(func, caller)
            if value is _NOT_READ:
                value = caller.grad_fn if grad_fn else caller.is_leaf if is_leaf else caller.requires_grad
            # (``is_leaf`` is noted even where the stand-in says the same: a recomputation's input need
            # not be a leaf, one whose graph a create_graph backward pass differentiates.)
            if value is None or (not grad_fn and not is_leaf and value == t.requires_grad):
                return _NOT_READ
            if self.callers_nodes is None:
                self.callers_nodes = CallersNodes()
            if grad_fn:
                self.callers_nodes.hand_out(i, value)
            else:
                (self.callers_nodes.is_leaf if is_leaf else self.callers_nodes.requires_grad)[i] = bool(value)
            return value
        assert self.callers_nodes is not None
        noted = self.callers_nodes.nodes if grad_fn else self.callers_nodes.is_leaf if is_leaf else self.callers_nodes.requires_grad
        value = noted.get(i)
        return _NOT_READ if value is None else value

    def _callers_hook(self, func: Any, t: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A hook registered on ``t``, an input's stand-in, where the caller's tensor is the one to
        have it: one that does not require grad where the caller's tensor does (a module's parameter
        under ``torch.func.grad``: see :meth:`_callers_read`; torch refuses it on the stand-in), or
        one of a torch.func level (a tensor the caller computed inside ``torch.func.grad``: the hook
        sees its whole gradient, not only the part through the call, and the stand-in's is never
        computed). The forward run registers it on the caller's tensor, as without remat, and the
        recomputation gets a handle to that one (see :class:`CallersNodes`). ``None`` where ``t`` is
        no such stand-in (under plain autograd the forward run moves an input's hooks once it ends:
        see ``funckpt._call._move_input_hooks``)."""
        if not isinstance(t, torch.Tensor):
            return None
        i = next((k for k, s in enumerate(self.inputs) if s is t), None)
        if i is None:
            return None
        if self.given is not None:  # (a forward run)
            caller = self.given[i]
            if caller is t:
                return None
            # (The stand-in of a run this one is nested in: registered where that run registers it.)
            handle = self._enclosing_hook(func, caller, rest, kwargs)
            if handle is None:
                if not caller.requires_grad or (t.requires_grad and not is_functorch_wrapped(caller)):
                    return None
                with torch._C.DisableTorchFunction():  # (the caller's tensor is no input of the runs around)
                    handle = func(caller, *rest, **kwargs)
            if self.callers_nodes is None:
                self.callers_nodes = CallersNodes()
            self.callers_nodes.hooked.add(i)
            self.callers_nodes.registered(handle.hooks_dict_ref(), handle)
            return handle
        assert self.callers_nodes is not None
        if i not in self.callers_nodes.hooked:
            return None
        return self.callers_nodes.registered_again(self)

    def _enclosing_hook(self, func: Any, t: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """:meth:`_callers_hook` of the innermost run this one is nested in that takes ``t``, its stand-in."""
        runs = _active.substitutes
        k = next((k for k in range(len(runs) - 1, -1, -1) if runs[k] is self), len(runs))
        for run in reversed(runs[:k]):
            if run.given is not None or run.callers_nodes is not None:
                handle = run._callers_hook(func, t, rest, kwargs)
                if handle is not None:
                    return handle
        return None

    def _enclosing_read(self, func: Any, t: torch.Tensor) -> Any:
        """What the runs this one is nested in give where ``t``, their input's stand-in, is read
        (see :meth:`_callers_read`), innermost first; :data:`_NOT_READ` where none does."""
        runs = _active.substitutes
        k = next((k for k in range(len(runs) - 1, -1, -1) if runs[k] is self), len(runs))
        for run in reversed(runs[:k]):
            if run.given is not None or run.callers_nodes is not None:
                value = run._callers_read(func, t, delegated=True)
                if value is not _NOT_READ:
                    return value
        return _NOT_READ

    def forget_hooks(self) -> list[tuple[dict[int, Any] | None, int, Handles]]:
        """The forward run's hooks on the tensors it made (see :func:`_register_followed_hook`), once it is
        over: their dicts are kept for the recomputation, each entry now a no-op, so as not to hold
        on to what the hook holds (the forward run's tensors, which would look kept outside the call).

        A hook the run removed itself (``handle.remove()`` in the function once a gradient of its own
        went through it, ``torch.autograd.grad`` inside; or the hook removing itself there) is noted
        with no dict: the recomputation registers it as it is and removes it at the same point, and its
        own gradient goes through it as the forward run's did. (Followed, it did not run there at all:
        a false "did not reproduce", or another gradient with the check off.)"""
        hooks, self.hooks = self.hooks or [], None
        noted: list[tuple[dict[int, Any] | None, int, Handles]] = []
        for mine, key, followed in hooks:
            assert mine is not None  # (a forward run notes each hook's dict)
            if key in mine:
                mine[key] = no_hook
                noted.append((mine, key, followed))
            else:
                noted.append((None, key, followed))
        return noted

    def _follow_unset(self, t: torch.Tensor) -> None:
        """Follow the storage of ``t``, allocated uninitialized, until it is written whole (see
        :meth:`_note_reads`); one that cannot be followed counts as read."""
        try:
            storage = bottom(t).untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            self.uninitialized = True
            return
        ref = storage_weak_ref(storage)
        self.unset[int(storage._cdata)] = (ref, storage.nbytes())
        self.allocated[int(storage._cdata)] = ref

    def _note_reads(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Of the storages the run allocated uninitialized (:attr:`unset`), those ``func`` writes whole
        are set from now on; one it takes otherwise (reads, views, writes in part) may carry garbage
        into what the run computes (:attr:`uninitialized`, and nothing more is followed)."""
        unset = self.unset
        if func in _METADATA:
            return
        # The places written whole: the first argument (or ``tensor=``) of what writes it so, and
        # ``out=``, where the tensor there covers its whole storage. A tensor on such a storage found
        # in any other place is read, also one written whole there too (``torch.add(t, 1, out=t)``
        # reads ``t`` before it writes it), and so is one on part of it (a view).
        written: list[int] = []
        for key, value in (*enumerate(args), *kwargs.items()):
            whole = key == "out" or (func in _WRITES_WHOLE and (key == 0 or (key == "tensor" and not args)))
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                b = bottom(t)
                storage = storage_of(b)
                if storage is None:
                    continue
                entry = unset.get(storage)
                if entry is None or storage_expired(entry[0]):
                    continue
                if not whole or b.storage_offset() or b.numel() * b.element_size() != entry[1]:
                    self.uninitialized = True
                    unset.clear()
                    return
                written.append(storage)
        for storage in written:
            unset.pop(storage, None)
        for storage in [k for k, (r, _) in unset.items() if storage_expired(r)]:  # (dead: never read)
            del unset[storage]

    def _plain(self, values: Iterable[Any]) -> bool:
        """Are ``values`` (an operator's arguments) the common case's (see :meth:`__torch_function__`):
        tensors the run made or gets as inputs (these noted as used) and values holding no tensor?"""
        known, inside, mapping = self.known, self.inside, self.mapping
        for a in values:
            if isinstance(a, torch.Tensor):
                key = id(a)
                if key in inside:
                    continue
                if key not in known or (mapping and key in mapping):
                    return False
                self.used.add(key)
            elif isinstance(a, (list, tuple)) and a and not self._plain(a):
                # (a shape, as layer_norm's; an index, x[..., :n]; the tensors torch.cat joins)
                return False
            elif type(a) is _GENERATOR and self.generator_ids is not None and id(a) not in self.generator_ids:
                return False  # (one the run is to note: see watch_generators)
        return True

    def _note_made_here(self, out: Any, made: list[weakref.ref[torch.Tensor]]) -> Any:
        """:meth:`__torch_function__`'s common case: ``out``'s tensors are the forward run's own
        (funckpt's own work for a nested region's: not among what the run made, as in the general case)."""
        inside = self.inside
        if _active.internal:
            made = []
        if isinstance(out, torch.Tensor):
            inside.add(id(out))
            made.append(weakref.ref(out))
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    inside.add(id(o))
                    made.append(weakref.ref(o))
        return out


def differentiable_input(t: torch.Tensor) -> bool:
    """Could a derivative flow into ``t``: does it require grad (at its torch.func level) or carry a tangent?"""
    return t.requires_grad or has_tangent(t)


def has_tangent(t: torch.Tensor) -> bool:
    """Is ``t`` a forward-mode dual (plain ``forward_ad`` or ``torch.func.jvp``)?

    Read with forward-mode AD enabled: a custom Function's forward runs with it
    disabled, which hides tangents.
    """
    if forward_ad_level() < 0:
        return False
    # funckpt's own work (set_internal): asked while the runs a call is nested in are on (a nested
    # remat's prepare), unpacking returns the caller's very tangent, which they must not count as
    # made by their function (under jvp(vmap(f)) it looked kept outside the enclosing call).
    internal = set_internal(True)
    try:
        with set_fwd_grad_enabled(True):
            return unpack_dual(t).tangent is not None
    except RuntimeError:  # inside vmap: no batching rule for _unpack_dual; assume it may carry one
        return is_functorch_wrapped(t)
    finally:
        set_internal(internal)


def local_graph_leaves(
    outputs: list[torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
    first_node: int,
    own: Callable[[torch.Tensor], bool],
    older_input: Callable[[int], bool] | None = None,
) -> tuple[bool, set[int]]:
    """Walk a run's local graph: does it reach anything foreign, and which of ``leaves``?

    Foreign: graph built before the run (autograd numbers nodes in creation order,
    from ``first_node`` on for the run's), or a leaf that is neither one of ``leaves``
    nor ``own``. The forward run's own leaves are those it made (a tensor created and
    then set to require grad: its gradient stays local, as under
    ``torch.utils.checkpoint``); an ``autograd.Function.apply`` bypasses torch-function
    modes, so a captured tensor passed straight to one is foreign there. The second
    result is the ids of the ``leaves`` the outputs depend on (the others are
    reachable but unused). ``older_input``: is a node built before the run (by its sequence
    number) one of the run's inputs' own, where the walk stops (a loop's step run again, whose
    carry has a graph: see ``StepRegion._refuse_unrouted``)?

    The walk holds every node it visited: a node's Python object may be made
    afresh on each access, and a freed one's ``id`` reused by the next.
    """
    known = {id(t) for t in leaves}
    reached: set[int] = set()
    foreign = False
    seen: dict[int, Any] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    pop, push = stack.pop, stack.append  # (a few thousand instructions a node: every one counts)
    while stack:
        node = pop()
        key = id(node)
        if key in seen:
            continue
        seen[key] = node
        if type(node) is AccumulateGrad:
            variable = node.variable  # type: ignore[attr-defined]  # (the leaf whose gradient it accumulates)
            if id(variable) in known:
                reached.add(id(variable))
            elif not own(variable):
                foreign = True
            continue
        number = node._sequence_nr()
        if number < first_node:
            if older_input is None or not older_input(number):
                foreign = True
            continue
        for child, _ in node.next_functions:
            if child is not None:
                push(child)
    return foreign, reached


def next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get.

    Read from autograd's own thread-local counter (no operator runs), so it is
    the same inside or outside transforms, inference mode and torch-function modes.
    """
    return sequence_nr()


def _foreign_level(t: torch.Tensor) -> bool:
    """A live functorch tensor whose level is not the same kind of level on the stack now."""
    if is_dead_tensor_wrapper(t):
        return False
    level = maybe_get_level(t)
    stack = interpreter_stack()
    for interpreter in stack:
        if interpreter.level() == level:
            kind = interpreter.key()
            batched = is_batchedtensor(t)
            return bool(batched != (kind == TransformType.Vmap))
    return True
