import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_restore_state():
    """Each test starts from a fixed seed and leaves grad mode as it found it."""
    torch.manual_seed(0)
    grad_mode = torch.is_grad_enabled()
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
