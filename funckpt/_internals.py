"""The torch internals funckpt relies on, in one place.

Every private torch symbol the library uses beyond ``torch.func``'s public
API is imported here, at the bottom of funckpt's import graph, and nowhere
else is meant to reach past the public API for these. Each has a comment on what
it is for; a torch upgrade that moves one breaks this module's import, not
code scattered across the package.
"""

from __future__ import annotations

import torch

# functorch's C++ bindings (torch >= 2.0): tensor wrappers, levels, the interpreter stack.
_C = torch._C._functorch

#: Is ``t`` a functorch wrapper (GradTrackingTensor, BatchedTensor)?
is_functorch_wrapped = _C.is_functorch_wrapped_tensor
#: The tensor one level below a functorch wrapper.
unwrap_one_level = _C.get_unwrapped

#: Runs the body with functorch's dispatch keys off: ops on plain tensors stay plain
#: even while transforms are active (torch >= 2.0).
DisableFuncTorch = torch._C._DisableFuncTorch


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
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
