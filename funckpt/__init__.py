"""funckpt: JAX-style activation checkpointing (rematerialization) for ``torch.func``.

``remat(fn)`` keeps only ``fn``'s inputs between the forward and the backward
pass and recomputes the rest, under ``torch.func.grad``, ``vjp``, ``jvp``,
``jacrev``, ``jacfwd``, ``hessian``, ``vmap``, their nestings, plain
autograd, ``torch.compile`` and DDP/FSDP2. See the README for a tour.
"""

from . import policies
from ._compat import checkpoint, checkpoint_sequential, noop_context_fn
from ._errors import CheckpointError, set_checkpoint_debug_enabled
from ._loops import fori_loop, scan, while_loop
from ._residuals import Residual, print_saved_residuals, saved_residuals
from ._transform import remat
from .policies import checkpoint_name

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Residual",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_sequential",
    "fori_loop",
    "noop_context_fn",
    "policies",
    "print_saved_residuals",
    "remat",
    "saved_residuals",
    "scan",
    "set_checkpoint_debug_enabled",
    "while_loop",
]
