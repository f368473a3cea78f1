"""``remat(module)``: an ``nn.Module`` that checkpoints another module's forward.

The wrapper shares the wrapped module's parameter, buffer and submodule
dictionaries instead of owning the module as a child, so it is a drop-in
replacement: ``state_dict()`` and ``named_parameters()`` have exactly the
original keys, ``load_state_dict`` accepts the original checkpoint, and
``torch.func.functional_call(wrapper, params_of_the_original, ...)`` works.

An ``nn.Sequential`` is checkpointed in segments instead of as one region:
with ``k`` segments (default about ``sqrt(len)``, the sublinear-memory choice
of Chen et al. 2016) every segment is remat'd, the last included, so
``remat(m)`` never keeps the internals of any part of ``m`` (a two-layer
Sequential inside a larger network saves memory like any other remat'd
module). ``checkpoint_sequential`` keeps PyTorch's semantics instead: its last
segment runs plainly. Between forward and backward only the segments' inputs
are kept; the backward pass recomputes one segment at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.nn.utils import parametrize

from ._call import call
from ._capture import Layers, is_fsdp2_module, submodule
from ._internals import share_fsdp2_state
from ._options import RematOptions


class Remat(torch.nn.Module):
    """Checkpoints ``module``'s forward; same parameters, buffers and keys as ``module``."""

    # Set with object.__setattr__ in __init__, outside nn.Module's registries.
    wrapped: torch.nn.Module
    _remat_options: RematOptions

    def __init__(self, module: torch.nn.Module, options: RematOptions) -> None:
        super().__init__()
        # Not registered as a child: its state is shared below, under its own names.
        object.__setattr__(self, "wrapped", module)
        object.__setattr__(self, "_remat_options", options)
        _resync(self)  # its registries and state-dict hooks, shared (_SHARED)
        self.training = module.training
        _own_class_if_parametrized(self)
        if is_fsdp2_module(module):
            # remat(fully_shard(block)): FSDP's hooks run around the checkpointed forward (see
            # _call._call_eagerly); fully_shard(model) must leave the parameters it shares alone.
            share_fsdp2_state(self, module)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save(model)``) as its plain class, not the one of its own it may have.

        Made by :func:`_new_instance` of its type, not by ``copyreg.__newobj__``, which pickle
        refuses for an object whose ``__class__`` (the class it poses as) is not its type.
        """
        reduced = super().__reduce_ex__(protocol)
        cls = type(self)
        if isinstance(reduced, tuple) and len(reduced) > 1:
            plain = cls.__bases__[0] if cls.__dict__.get("_funckpt_own_class") else cls
            return (_new_instance, (plain,), *reduced[2:])
        return reduced

    def _poses_as(self) -> type:
        """The class ``isinstance`` sees (``__class__``): a subclass of both the wrapper's type and
        the wrapped module's class, so that ``isinstance(remat(layer), type(layer))`` holds.

        Libraries find a model's layers by class: transformers installs the hooks that collect
        ``output_hidden_states`` on every module that is an instance of the decoder layer's
        class. A wrapper that is not one would be skipped, and its hidden states silently
        missing. Only ``isinstance`` (and code reading ``__class__``) sees this class: the
        wrapper's type, and so how its attributes resolve, stays its own. Not where the wrapper
        or the wrapped module is parametrized: torch's parametrize adds a property to the class
        it reads here, which must then be the wrapper's type.
        """
        wrapped = self.__dict__.get("wrapped")
        if wrapped is None:
            return type(self)
        if "parametrizations" in (self.__dict__.get("_modules") or ()):
            # torch's parametrize adds a property to this class for each tensor parametrized: the
            # wrapper's own (parametrized since the wrapping, it gets one now), which its type is.
            _own_class_if_parametrized(self)
            return type(self)
        pair: Any = (type(self), type(wrapped))  # (Any: mypy takes a class with a __class__ property for unhashable)
        return _posing_class(*pair)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A posing class, or one built on it, is a ``Remat`` and nothing else: the wrapped class's
        ``__init_subclass__`` (a registry of subclasses, transformers' checkpointing ``forward``
        that ``GradientCheckpointingLayer`` gives each subclass) is not run for it."""
        if any(c.__dict__.get("_funckpt_posing") for c in cls.__mro__):
            return
        super().__init_subclass__(**kwargs)

    def _set_class(self, cls: type) -> None:
        """Code that gives a module a subclass of its ``__class__`` (torch's ``register_parametrization``,
        FSDP's ``fully_shard``) subclassed the posing class: the wrapper gets the same class with the
        wrapper's type in its place, so its attributes resolve as before."""
        _OBJECT_CLASS.__set__(self, _unposed(cls))

    __class__ = property(_poses_as, _set_class)

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        _own_class_if_parametrized(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _resync(self)
        _share_parametrizations(self)
        return call(self.wrapped, self._remat_options, args, kwargs, wrapped=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's own ``state_dict``: its entries under the same keys, and also its
        version metadata, its extra state (``get_extra_state``), its hooks and its class's
        ``_save_to_state_dict``, none of which the wrapper's own would give."""
        return self.wrapped.state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Loaded as the wrapped module loads itself (its class's override, its pre-hooks, its
        extra state, by its version); the submodules, shared, are loaded after it as usual."""
        _resync(self)  # the submodules loaded next are found in the wrapper's ``_modules``
        self.wrapped._load_from_state_dict(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        _resync(self)  # parameters(), named_parameters(), buffers(), modules() go through here
        return super().named_modules(*args, **kwargs)

    def named_children(self) -> Any:
        _resync(self)  # children(), and so train(), eval(), to(), apply()
        return super().named_children()

    def __getattr__(self, name: str) -> Any:
        """The wrapped module's other attributes read through (``layer.attention_type``, ...).

        Models read their layers' plain attributes (HF ModernBERT, Swin); a
        remat'd layer must answer as the layer does.
        """
        _resync(self)  # a submodule by name (``functional_call``'s ``"1.weight"``) is looked up here
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("wrapped")
            if wrapped is None:
                raise
            if name in (wrapped.__dict__.get("_funckpt_shared_parametrizations") or {}).get("names", ()):
                _share_parametrizations(self)  # removed from the wrapper since? not read through then
            return getattr(wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """The wrapped module's other attributes are written through, as they are read through.

        Code that configures a model by setting its modules' attributes (diffusers'
        ``enable_freeu`` on each up block, ``m.fused_attn = False``, a scale or a flag)
        would otherwise set them on the wrapper, where reads see them but the wrapped
        module's forward does not: the call would silently run unconfigured. The wrapper's
        own state (``training``, its hooks, the registries it shares, what ``nn.Module``
        or ``Remat`` defines) stays on the wrapper.
        """
        wrapped = self.__dict__.get("wrapped")
        if wrapped is None or name in self.__dict__ or hasattr(type(self), name):
            super().__setattr__(name, value)
            if name == "training" and wrapped is not None:
                # Both flags, as train() sets them: ``for m in model.modules(): m.training = False``
                # reaches the wrapper (the wrapped module is not among them), whose forward runs
                # the wrapped module: left in the other mode, it would silently run so.
                wrapped.training = value
        else:
            setattr(wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        wrapped = self.__dict__.get("wrapped")
        shared = (self._parameters, self._buffers, self._modules)
        if wrapped is None or name in self.__dict__ or any(name in d for d in shared):
            super().__delattr__(name)
        else:
            delattr(wrapped, name)

    def train(self, mode: bool = True) -> Remat:
        """The wrapped module's own ``train``: its class's override runs (a block that keeps its
        BatchNorm frozen, ``super().train(mode); self.bn.eval()``), on the layers, which it shares."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")  # (nn.Module.train's error)
        _resync(self)
        self.wrapped.train(mode)
        torch.nn.Module.__setattr__(self, "training", self.wrapped.training)  # type: ignore[arg-type]  # (whatever the override set)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> Remat:
        """The wrapped module's own ``_apply``, which ``to``, ``half``, ``cuda``, ``to_empty`` go
        through: its class's override runs (a buffer kept in float32, an LSTM's flat weights)."""
        _resync(self)
        self.wrapped._apply(fn, recurse)  # type: ignore[no-untyped-call]
        _resync(self)
        return self

    def _get_name(self) -> str:
        return type(self).__name__  # (in its repr: the wrapper's type, not the class it poses as)

    def extra_repr(self) -> str:
        return f"wrapped={type(self.wrapped).__name__}"


def _new_instance(cls: type[torch.nn.Module]) -> torch.nn.Module:
    """A wrapper of type ``cls``, uninitialized: what unpickling a wrapper starts from (its state follows)."""
    if not (isinstance(cls, type) and issubclass(cls, Remat)):
        raise TypeError(f"funckpt: _new_instance makes remat wrappers only, not {cls!r}")
    return cls.__new__(cls)


# A wrapper is pickled as _new_instance(its type) (see Remat.__reduce_ex__): loading one with
# torch.load(weights_only=True) needs the same classes allowed as before, not this function too.
torch.serialization.add_safe_globals([_new_instance])


_OBJECT_CLASS = object.__dict__["__class__"]  # (the descriptor Remat's __class__ property stands in front of)


@functools.lru_cache(maxsize=1024)  # (bounded: torch's parametrize makes a class per module)
def _posing_class(cls: type, wrapped: type) -> type:
    """A subclass of ``cls`` (a wrapper's type) and ``wrapped`` (the wrapped module's class), named as
    ``wrapped``, for ``isinstance`` only (see :meth:`Remat._poses_as`); ``cls`` where none can be made.

    Named as the wrapped class for the code that finds layers by class name (``transformers``'
    ``fsdp_transformer_layer_cls_to_wrap``, ``accelerate``'s ``no_split_module_classes``).
    """
    if issubclass(cls, wrapped):
        return cls
    namespace = {"__module__": wrapped.__module__, "__qualname__": wrapped.__qualname__, "_funckpt_posing": True}
    try:
        return type(wrapped.__name__, (cls, wrapped), namespace)
    except Exception:  # (a layout or metaclass conflict, a final class, an __init_subclass__ that refuses)
        return cls


@functools.lru_cache(maxsize=1024)
def _unposed(cls: type) -> type:
    """``cls`` with each posing base (:func:`_posing_class`) replaced by the wrapper type it poses for."""
    bases = tuple(b.__bases__[0] if b.__dict__.get("_funckpt_posing") else b for b in cls.__bases__)
    if bases == cls.__bases__:
        return cls
    namespace = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, bases, namespace)


def _own_class_if_parametrized(wrapper: Remat) -> None:
    """``parametrizations`` is shared, so torch takes the wrapper of a parametrized module for one
    that is parametrized already and would add a parametrization registered on it
    (``register_parametrization(wrapper, "bias", ...)``) as a property of ``Remat`` itself, for every
    wrapper: such a wrapper gets a class of its own to take it."""
    wrapped = wrapper.__dict__.get("wrapped")
    cls = type(wrapper)
    if wrapped is None or cls.__dict__.get("_funckpt_own_class") or not parametrize.is_parametrized(wrapped):
        return
    if cls is not Remat and cls is not RematSequential:
        return  # parametrized through the wrapper already, or a subclass: torch's class, or the user's
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_funckpt_own_class": True}
    wrapper.__class__ = type(cls.__name__, (cls,), namespace)


#: What a wrapper shares with the module it wraps: its registries, and its state-dict hooks
#: (spectral_norm's version metadata, user hooks: one set, whichever of the two they are
#: registered on).
_SHARED = (
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _resync(wrapper: Remat) -> None:
    """Share the wrapped module's dictionaries (:data:`_SHARED`): at the wrapper's making, and
    again wherever the module has replaced one since.

    ``nn.Sequential.__delitem__`` and ``pop`` (also reached through the wrapper, ``remat(seq).pop(0)``)
    renumber the layers into a *new* ``_modules`` dictionary: the wrapper's would go on naming the
    removed layer and the old numbers, so its ``named_parameters``, ``functional_call`` by name and
    ``load_state_dict`` (of the wrapper's own ``state_dict``, which is the wrapped module's) would
    disagree with the module it runs.
    """
    d = wrapper.__dict__
    w = d.get("wrapped")
    if w is None:
        return
    wd = w.__dict__
    for name in _SHARED:
        if d.get(name) is not wd.get(name) and name in wd:
            d[name] = wd[name]


def _own_properties(cls: type, names: Any) -> list[str]:
    return [n for n in names if isinstance(cls.__dict__.get(n), property)]


def _share_parametrizations(wrapper: Remat) -> None:
    """Parametrizations registered on the wrapper (``parametrizations.orthogonal(remat(layer))``)
    reach the wrapped module, whose forward reads the tensor.

    ``register_parametrization`` moves ``weight`` out of the parameter dictionary, which the two
    share, into ``parametrizations`` (also shared), and gives the *wrapper's* class a ``weight``
    property: the wrapped module's forward would read ``self.weight`` and find nothing. So the
    wrapped module's class gets the same property, reading the same shared parametrization, as
    if it had been parametrized itself (before remat, which works); a parametrization removed
    from the wrapper since (``remove_parametrizations``) is removed from it too.
    """
    wrapped = wrapper.wrapped
    state = wrapped.__dict__.get("_funckpt_shared_parametrizations")
    plist = submodule(wrapper, "parametrizations")
    if plist is None and not state:
        return  # nothing parametrized: the usual case
    # The parametrizations are one ModuleDict, shared by the module and all its wrappers: what
    # it holds is what is parametrized, whichever of them it was registered or removed through
    # (another wrapper of the same module has none of the properties on its class).
    names = set(plist.keys()) if isinstance(plist, torch.nn.ModuleDict) else set()
    if state is None:
        state = wrapped.__dict__["_funckpt_shared_parametrizations"] = {"names": set(), "new_class": False}
    for name in sorted(state["names"] - names):  # removed since (remove_parametrizations)
        if isinstance(type(wrapped).__dict__.get(name), property):
            delattr(type(wrapped), name)
        state["names"].discard(name)
    if state["new_class"] and not state["names"]:
        wrapped.__class__ = type(wrapped).__bases__[0]
        state["new_class"] = False
    missing = [n for n in sorted(names) if not isinstance(type(wrapped).__dict__.get(n), property)]
    if missing and not _own_properties(type(wrapped), names):  # not parametrized itself: its own class
        parametrize._inject_new_class(wrapped)
        state["new_class"] = True
    for name in missing:
        parametrize._inject_property(wrapped, name)
        state["names"].add(name)


def default_segments(length: int) -> int:
    """About the square root of the number of layers, at least 1."""
    return max(1, round(math.sqrt(length)))


def split(length: int, segments: int) -> list[tuple[int, int]]:
    """``segments`` contiguous ``(start, stop)`` ranges covering ``range(length)``.

    Like ``checkpoint_sequential``: equal segments of ``length // segments``
    layers, the last one taking the remainder.
    """
    if length == 0:
        return []
    segments = min(segments, length)
    size = length // segments
    bounds = [(i * size, (i + 1) * size) for i in range(segments - 1)]
    return bounds + [((segments - 1) * size, length)]


def _off_in_place_layers(ranges: list[tuple[int, int]], layers: Sequence[Any]) -> list[tuple[int, int]]:
    """``ranges`` with each boundary moved past the layers that would write the segment's input
    in place: a layer with ``inplace=True`` (torch's activations and dropouts), reached from the
    boundary through layers that may hand on their input itself or a view of it (``Identity``,
    a dropout in eval mode, ``Flatten``), or first in a nested ``Sequential``.

    Such a layer first in a segment would write that segment's input, the previous segment's
    output, which the recomputation must start from (remat refuses the write). Inside a
    segment it writes an intermediate, as it does without remat. A segment left empty merges
    into the one before it.
    """
    cuts: list[int] = []
    for start, _ in ranges[1:]:
        start = _past_input_writers(layers, start)
        if start < len(layers) and (not cuts or start > cuts[-1]):
            cuts.append(start)
    return list(zip([0, *cuts], [*cuts, len(layers)]))


#: Layers that may return their input itself or a view of it (a dropout in eval mode or with
#: p=0, a flatten of a contiguous tensor): a write by the next layer reaches their input.
_PASS_THROUGH = (
    torch.nn.Identity,
    torch.nn.modules.dropout._DropoutNd,
    torch.nn.Flatten,
    torch.nn.Unflatten,
)


def _past_input_writers(layers: Sequence[Any], start: int) -> int:
    """The first position at or after ``start`` where a segment can begin without its layers
    writing its input (``start`` itself unless a layer from there may: see :func:`_off_in_place_layers`)."""
    j = start
    while j < len(layers) and _passes_through(layers[j]):
        j += 1
    if j < len(layers) and _writes_its_input(layers[j]):
        return _past_input_writers(layers, j + 1)
    return start


def _passes_through(layer: Any) -> bool:
    if isinstance(layer, torch.nn.Sequential):
        return all(_passes_through(inner) for inner in layer)
    return isinstance(layer, _PASS_THROUGH) and getattr(layer, "inplace", False) is not True


def _writes_its_input(layer: Any) -> bool:
    if isinstance(layer, torch.nn.Sequential):
        return _past_input_writers(list(layer), 0) > 0
    return getattr(layer, "inplace", False) is True


def run_in_segments(
    layers: Sequence[Any],
    segments: int,
    x: Any,
    options: RematOptions,
    *,
    checkpoint_last: bool,
    move_off_in_place: bool = False,
) -> Any:
    """Run ``layers`` in order in ``segments`` remat'd chunks; the last one plainly unless ``checkpoint_last``.

    ``move_off_in_place``: no segment but the first starts with a layer that writes its input
    (:func:`_off_in_place_layers`); ``checkpoint_sequential`` cuts where torch's does.
    """
    ranges = split(len(layers), segments)
    if move_off_in_place:
        ranges = _off_in_place_layers(ranges, layers)
    remat_ranges = ranges if checkpoint_last else ranges[:-1]
    for a, b in remat_ranges:
        x = call(_Chain(list(layers[a:b]), a), options, (x,), {})
    if not checkpoint_last:
        for f in layers[ranges[-1][0] :] if ranges else ():
            x = f(x)
    return x


class _Chain:
    """Calls its layers in order; remat finds their parameters through ``layers``."""

    def __init__(self, layers: list[Any], start: int) -> None:
        self.layers = Layers(layers)
        self.__name__ = f"segment of layers {start} to {start + len(layers) - 1}"  # (named in remat's errors)

    def __call__(self, x: Any) -> Any:
        for f in self.layers:
            x = f(x)
        return x


def _has_hooks(module: torch.nn.Module) -> bool:
    """Does ``module`` itself have forward or backward hooks (its layers' are not counted)?"""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


class RematSequential(Remat):
    """An ``nn.Sequential`` checkpointed segment by segment, every segment (the last included).

    The layers are read at every call, so replacing a layer of the wrapped
    ``Sequential`` afterwards is seen.
    """

    wrapped: torch.nn.Sequential
    requested_segments: int | None

    def __init__(self, module: torch.nn.Sequential, options: RematOptions) -> None:
        super().__init__(module, dataclasses.replace(options, segments=None))
        object.__setattr__(self, "requested_segments", options.segments)

    @property
    def num_segments(self) -> int:
        n = len(self.wrapped)
        return min(n, self.requested_segments or default_segments(n)) if n else 0

    def forward(self, x: Any) -> Any:
        _resync(self)
        _share_parametrizations(self)
        if _has_hooks(self.wrapped):
            # Segments would call the layers, not the Sequential: its own hooks would not run.
            # One region around the Sequential's own call keeps them.
            return call(self.wrapped, self._remat_options, (x,), {}, wrapped=True)
        return run_in_segments(
            list(self.wrapped),
            self.num_segments or 1,
            x,
            self._remat_options,
            checkpoint_last=True,
            move_off_in_place=True,
        )

    # Read like the Sequential it wraps: len(m), m[i], for layer in m.
    def __len__(self) -> int:
        return len(self.wrapped)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self.wrapped)

    def __getitem__(self, index: int | slice) -> Any:
        return self.wrapped[index]

    # Written like it too: m[i] = layer, del m[i] (pop, reached through, renumbers the same way).
    def __setitem__(self, index: int, module: torch.nn.Module) -> None:
        self.wrapped[index] = module
        _resync(self)

    def __delitem__(self, index: int | slice) -> None:
        del self.wrapped[index]
        _resync(self)

    def extra_repr(self) -> str:
        return f"wrapped=Sequential, segments={self.num_segments}"
