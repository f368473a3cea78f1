"""Flattening of arguments and outputs into flat tuples of tensors (with optree).

remat's autograd machinery only ever sees a flat tuple of tensors in and a flat
tuple of tensors out. This module converts between that view and the user's
pytrees: positional and keyword arguments become one flat list of leaves, the
tensor leaves become inputs, every other leaf (ints, strings, ``None``,
arbitrary objects) is kept aside and passed back as it was. Positions listed in
``static_argnums`` are never flattened.

Custom containers become pytree nodes when registered with optree, either
globally or, following torchopt's convention, in funckpt's namespace::

    optree.register_pytree_node(MyType, flatten_fn, unflatten_fn, namespace="funckpt")

A type registered with torch's own pytree only (transformers' ``ModelOutput``
classes) is registered in funckpt's namespace, with torch's functions, the first
time it appears.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ._internals import PLAIN_TENSORS, torch_pytree_node

NAMESPACE = "funckpt"  # optree resolves this namespace and the global registry


@dataclass(frozen=True)
class TreeSlots:
    """A flattened pytree: its structure, the non-tensor leaves, and the tensor slots.

    ``leaves[i]`` is the original leaf for non-tensor positions and ``None`` for
    tensor positions; ``tensor_positions`` lists the latter in order.
    """

    treespec: optree.PyTreeSpec
    leaves: tuple[Any, ...]
    tensor_positions: tuple[int, ...]
    # The shapes of tree built without optree (see _plain_slots): "" for any other.
    plain: str = ""

    def fill(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self.plain:
            if len(tensors) != len(self.leaves):
                raise ValueError(f"expected {len(self.leaves)} tensors, got {len(tensors)}")
            if self.plain == "leaf":
                return tensors[0]
            return tuple(tensors) if self.plain == "tuple" else (tuple(tensors), {})
        if len(self.tensor_positions) == len(self.leaves):  # every leaf a tensor (unflatten checks the count)
            return optree.tree_unflatten(self.treespec, tensors)
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_positions, tensors, strict=True):
            leaves[pos] = t
        return optree.tree_unflatten(self.treespec, leaves)


# Tensors of the exact types in PLAIN_TENSORS are leaves in every optree namespace.

# Types torch's pytree flattens that stay leaves here: ``torch.Size`` holds ints only, and torch
# rebuilds it as a plain tuple (a shape argument or output would lose ``numel()``, and
# ``isinstance(s, torch.Size)``); optree, like the un-remat'd function, passes it as it is.
_TORCH_PYTREE_LEAVES = frozenset({torch.Size})


@functools.lru_cache(maxsize=256)
def _plain_slots(shape: str, n: int) -> TreeSlots:
    """The slots of a tree of ``n`` plain tensors: one tensor ("leaf"), a tuple of them
    ("tuple") or positional arguments and no keyword ones ("args", ``(tensors, {})``).

    The same value optree's flattening gives (its structure included, which
    errors print and recomputations compare), made once per shape: a remat'd
    call's arguments and outputs are usually such trees, and flattening them
    with optree on every call costs more than the rest of their handling.
    """
    # Any leaf gives the same structure; not a tensor: allocating one here, inside an
    # enclosing remat's run, would count as that run's (uninitialized) operator.
    dummy = object()
    tree: Any = dummy if shape == "leaf" else (dummy,) * n if shape == "tuple" else ((dummy,) * n, {})
    treespec = optree.tree_structure(tree, none_is_leaf=False, namespace=NAMESPACE)
    return TreeSlots(treespec, (None,) * n, tuple(range(n)), shape)


def _all_plain(items: tuple[Any, ...]) -> bool:
    for item in items:
        if type(item) not in PLAIN_TENSORS:
            return False
    return True


def flatten(tree: Any) -> tuple[list[torch.Tensor], TreeSlots]:
    """Split ``tree`` into its tensor leaves and everything needed to rebuild it."""
    kind = type(tree)
    if kind in PLAIN_TENSORS:
        return [tree], _plain_slots("leaf", 1)
    if kind is tuple and _all_plain(tree):
        return list(tree), _plain_slots("tuple", len(tree))
    return _flatten(tree)


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """optree's ``tree_flatten`` in funckpt's namespace, each container only torch's pytree
    knows registered first (:func:`_register_torch_pytree_types`)."""
    leaves, treespec = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
    while _register_torch_pytree_types(leaves):  # (their children may be such types too)
        leaves, treespec = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
    return leaves, treespec


def _flatten(tree: Any) -> tuple[list[torch.Tensor], TreeSlots]:
    leaves, treespec = tree_flatten(tree)
    tensors = []
    positions = []
    kept: list[Any] = []
    for i, leaf in enumerate(leaves):
        if type(leaf) not in weakref.ProxyTypes and isinstance(leaf, torch.Tensor):  # a dead proxy raises
            tensors.append(leaf)
            positions.append(i)
            kept.append(None)
        else:
            kept.append(leaf)
    return tensors, TreeSlots(treespec, tuple(kept), tuple(positions))


def _register_torch_pytree_types(leaves: Sequence[Any]) -> bool:
    """Register with optree, in funckpt's namespace, each leaf type that torch's own pytree flattens.

    Libraries register their containers with ``torch.utils._pytree`` (transformers does
    for every ``ModelOutput``: ``BaseModelOutput``, ``CausalLMOutputWithPast``, ...), not
    with optree, which would treat them as opaque leaves and the tensors inside as no
    outputs. Registered here with torch's own functions, they flatten the same way in
    both. A type optree already flattens never shows up as a leaf, so nothing is
    registered twice. Returns whether any type was registered (flatten again).
    """
    new = False
    tried: set[type] = set()
    for leaf in leaves:
        kind = type(leaf)
        if kind in tried or kind in weakref.ProxyTypes or kind in PLAIN_TENSORS or kind in _TORCH_PYTREE_LEAVES:
            continue  # (a dead proxy raises on use)
        tried.add(kind)
        node = torch_pytree_node(kind)
        if node is None:
            continue
        flatten_fn, unflatten_fn = node

        def unflatten(context: Any, children: Any, unflatten_fn: Any = unflatten_fn) -> Any:
            return unflatten_fn(list(children), context)

        try:
            optree.register_pytree_node(kind, flatten_fn, unflatten, namespace=NAMESPACE)
        except ValueError:  # registered meanwhile by another thread (then flatten again), or refused
            if optree.tree_structure(leaf, none_is_leaf=False, namespace=NAMESPACE).is_leaf():
                continue
        new = True
    return new


@dataclass(frozen=True)
class ArgSpec:
    """How to rebuild ``(args, kwargs)`` from flat tensors; static args kept whole."""

    dynamic: TreeSlots
    static: dict[int, Any]
    nargs: int

    @property
    def tensors_only(self) -> bool:
        """Are the arguments positional plain tensors and nothing else (no container, no static argument)?"""
        return self.dynamic.plain == "args" and not self.static

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dyn_args, kwargs = self.dynamic.fill(tensors)
        if not self.static:
            return dyn_args, kwargs
        it = iter(dyn_args)
        args = tuple(self.static[i] if i in self.static else next(it) for i in range(self.nargs))
        return args, kwargs


def flatten_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], static_argnums: tuple[int, ...]
) -> tuple[list[torch.Tensor], ArgSpec]:
    static = {i: args[i] for i in static_argnums}
    dynamic = tuple(a for i, a in enumerate(args) if i not in static) if static else args
    if not kwargs and _all_plain(dynamic):
        return list(dynamic), ArgSpec(_plain_slots("args", len(dynamic)), static, len(args))
    tensors, slots = _flatten((dynamic, kwargs))
    return tensors, ArgSpec(slots, static, len(args))


#: The containers a function may write into. What it is passed of these is a copy (optree rebuilds
#: them around remat's own tensors, :meth:`ArgSpec.rebuild`), whose writes remat carries back.
MUTABLE = (list, dict, collections.deque)
#: Leaves no container is inside, told without asking optree.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.Tensor)


def argument_containers(caller: tuple[Any, ...], copy: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(the caller's container, the function's copy of it)`` for each list, dict and deque
    among ``caller``, arguments (a tuple of positional ones and a dict of keyword ones), at
    any depth, the outermost first; ``copy``: the same arguments as rebuilt for the function.
    (The keyword dict itself is not one: Python gives every call a fresh one.)"""
    pairs: list[tuple[Any, Any]] = []
    (args, kwargs), (args_copy, kwargs_copy) = caller, copy
    for a, b in zip(args, args_copy):
        _pair(a, b, pairs)
    for key, a in kwargs.items():
        _pair(a, kwargs_copy[key], pairs)
    return pairs


@functools.lru_cache(maxsize=256)
def holds_containers(treespec: optree.PyTreeSpec) -> bool:
    """Does a structure of arguments, ``(positional, keyword)``, hold a list, dict or deque
    (not counting the keyword dict itself)? Told once per structure: asked on every call."""
    args, kwargs = treespec.children()
    return _has_mutable(args) or any(_has_mutable(child) for child in kwargs.children())


def _has_mutable(treespec: optree.PyTreeSpec) -> bool:
    kind = treespec.type
    if kind is None:  # (a leaf)
        return False
    return issubclass(kind, MUTABLE) or any(_has_mutable(child) for child in treespec.children())


def _pair(a: Any, b: Any, pairs: list[tuple[Any, Any]]) -> None:
    if a is b or isinstance(a, _ATOMS) or type(a) is not type(b):  # (a leaf, passed as it is or as a tensor)
        return
    kind = type(a)
    if isinstance(a, MUTABLE):
        pairs.append((a, b))
    children: Any
    copies: Any
    if kind is list or kind is tuple or kind is collections.deque:  # (asked on every call: no optree round trip)
        children, copies = a, b
    elif kind is dict and len(a) == len(b):
        children, copies = a.values(), [b.get(k) for k in a]
    else:
        try:
            children = optree.tree_flatten_one_level(a, none_is_leaf=False, namespace=NAMESPACE)[0]
            copies = optree.tree_flatten_one_level(b, none_is_leaf=False, namespace=NAMESPACE)[0]
        except ValueError:  # (a leaf optree does not enter)
            return
    for x, y in zip(children, copies):
        if not isinstance(x, _ATOMS):
            _pair(x, y, pairs)


def map_back(value: Any, back: dict[int, Any]) -> Any:
    """``value`` with each object ``back`` names (by id) replaced by the one it maps to, at any
    depth of the containers optree enters: a write of ``[x, x.sin()]`` into an argument's list
    holds the caller's ``x``, not remat's stand-in for it (whose gradient would be missing). A
    container is rebuilt where an entry changed (as remat rebuilds what the function returns:
    the function's own object, left as it is, may be part of its result, still to be read)."""
    memo: dict[int, Any] = {}

    def walk(v: Any) -> Any:
        mine = back.get(id(v))
        if mine is not None:
            return mine
        if isinstance(v, _ATOMS):
            return v
        if id(v) in memo:  # (a container held twice, or inside itself)
            return memo[id(v)]
        memo[id(v)] = v
        try:
            flat = optree.tree_flatten_one_level(v, none_is_leaf=True, namespace=NAMESPACE)
        except ValueError:  # (a leaf optree does not enter)
            return v
        children = flat.children
        mapped = [walk(c) for c in children]
        if all(a is b for a, b in zip(mapped, children)):
            return v
        memo[id(v)] = rebuilt = flat.unflatten_func(flat.metadata, mapped)
        return rebuilt

    return walk(value)
