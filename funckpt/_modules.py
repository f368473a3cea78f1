"""``remat(module)``: an ``nn.Module`` that checkpoints another module's forward.

The wrapper shares the wrapped module's parameter, buffer and submodule
dictionaries instead of owning the module as a child, so it is a drop-in
replacement: ``state_dict()`` and ``named_parameters()`` have exactly the
original keys, ``load_state_dict`` accepts the original checkpoint, and
``torch.func.functional_call(wrapper, params_of_the_original, ...)`` works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._transform import RematOptions


class Remat(torch.nn.Module):
    """Checkpoints ``module``'s forward; same parameters, buffers and keys as ``module``."""

    def __init__(self, module: torch.nn.Module, options: RematOptions) -> None:
        super().__init__()
        # Not registered as a child: its state is shared below, under its own names.
        object.__setattr__(self, "wrapped", module)
        object.__setattr__(self, "_remat_options", options)
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self.training = module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from ._transform import call

        return call(self.wrapped, self._remat_options, args, kwargs)

    def train(self, mode: bool = True) -> Remat:
        super().train(mode)
        self.wrapped.training = mode
        return self

    def extra_repr(self) -> str:
        return f"wrapped={type(self.wrapped).__name__}"
