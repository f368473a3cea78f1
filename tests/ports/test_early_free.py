"""test_utils.py TestCheckpoint.test_checkpointing_without_reentrant_early_free, CPU port:
instead of torch.cuda.memory_allocated, count the intermediates (weakrefs) still alive when
each gradient hook fires; during the backward they must decrease (freed as soon as used)."""
import weakref, gc
import pytest
import torch, torch.func as tf
import funckpt
from funckpt import remat, checkpoint

def run(wrap):
    created = []
    stats = [None] * 3
    def track(x, idx):
        def hook(g):
            stats[idx] = sum(r() is not None for r in created[-4:])
        x.register_hook(hook)
    def test_fn(x):
        x = x ** 2; created.append(weakref.ref(x)); track(x, 2)
        x = x ** 2; created.append(weakref.ref(x)); track(x, 1)
        x = x ** 2; created.append(weakref.ref(x)); track(x, 0)
        x = x ** 2; created.append(weakref.ref(x))
        return x.sum()
    gc.disable()
    try:
        x = torch.randn(1000, requires_grad=True)
        out = wrap(test_fn)(x)
        out.backward()
    finally:
        gc.enable()
    return stats

@pytest.mark.parametrize("wrap", ["checkpoint", "remat"])
def test_early_free(wrap):
    w = {"checkpoint": lambda f: (lambda x: checkpoint(f, x, use_reentrant=False)), "remat": remat}[wrap]
    stats = run(w)
    assert None not in stats, stats
    assert stats[0] >= stats[1] >= stats[2], stats
    assert stats[0] > stats[2], stats
