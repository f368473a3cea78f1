import os

import pytest
import torch

#: ``FUNCKPT_TEST_DEVICE=cuda`` runs every test with that default device (``torch.set_default_device``):
#: the tensors tests make without naming a device are made there. ``.ci/gpu`` uses it on a GPU
#: machine to sweep the suite through the accelerator paths; tests that build CPU-only objects
#: (a CPU generator, a CPU memory measurement) then fail for that reason, not funckpt's.
DEFAULT_DEVICE = os.environ.get("FUNCKPT_TEST_DEVICE")
if DEFAULT_DEVICE:  # before collection too: test modules make tensors at import
    torch.set_default_device(DEFAULT_DEVICE)


@pytest.fixture(autouse=True)
def _seed_and_restore_state():
    """Each test starts from a fixed seed and leaves grad mode as it found it."""
    torch.manual_seed(0)
    grad_mode = torch.is_grad_enabled()
    if DEFAULT_DEVICE:
        torch.set_default_device(DEFAULT_DEVICE)
    yield
    assert torch.is_grad_enabled() == grad_mode, "a test left grad mode changed"
    assert torch._C._functorch.peek_interpreter_stack() is None, "a test left a functorch level on the stack"


@pytest.fixture
def routed(monkeypatch):
    """Route ``torch.utils.checkpoint.checkpoint`` to ``funckpt.checkpoint``: what a library that
    looks it up at call time (timm's checkpoint helpers, diffusers' default checkpointing function)
    then calls. Returns the list of calls made, so a test can check that checkpointing happened."""
    import torch.utils.checkpoint

    import funckpt

    calls: list = []

    def checkpoint(function, *args, **kwargs):
        calls.append(function)
        return funckpt.checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", checkpoint)
    return calls
