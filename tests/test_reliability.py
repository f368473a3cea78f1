"""No leaks across steps, and concurrent use from several threads."""

import threading

import pytest

import torch
import torch.func as tf
from torch.testing import assert_close

from benchmarks._common import held_bytes
from funckpt import policies, remat

D = torch.float64


def block(w, x):
    return x + torch.tanh(x @ w) @ w.T


def loss(block_fn):
    return lambda ws, x: _chain(block_fn, ws, x).square().mean()


def _chain(block_fn, ws, x):
    for w in ws:
        x = block_fn(w, x)
    return x


WS = [torch.randn(32, 32, dtype=D) / 6 for _ in range(4)]
X = torch.randn(64, 32, dtype=D)


def test_no_memory_growth_over_steps_under_torch_func_grad():
    for policy in (None, policies.dots_saveable):
        step = remat(block, policy=policy)

        def twenty_steps():
            for _ in range(20):
                tf.grad(loss(step))(WS, X)

        twenty_steps()
        assert held_bytes(twenty_steps) == 0


def test_no_memory_growth_over_steps_under_backward():
    leaves = [w.clone().requires_grad_() for w in WS]
    step = remat(block, policy=policies.dots_saveable)

    def twenty_steps():
        for _ in range(20):
            for w in leaves:
                w.grad = None
            loss(step)(leaves, X).backward()
        for w in leaves:
            w.grad = None

    twenty_steps()
    assert held_bytes(twenty_steps) == 0


def test_concurrent_gradients_from_threads_equal_serial_results():
    step = remat(block, policy=policies.dots_saveable)
    inputs = [torch.randn(64, 32, dtype=D, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    serial = [tf.grad(loss(step))(WS, x) for x in inputs]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            for _ in range(10):
                results[i] = tf.grad(loss(step))(WS, inputs[i])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        assert_close(results[i], serial[i])


def _watch_kept_values(monkeypatch) -> list:
    """Weak references to every value a saving policy keeps, as the forward run ends."""
    import weakref

    from funckpt import _saving

    refs: list = []
    finish = _saving.Saved.finish_forward

    def finish_and_watch(self, outputs):
        finish(self, outputs)
        refs.append([weakref.ref(t) for t in optree_tensors(self.kept)])

    monkeypatch.setattr(_saving.Saved, "finish_forward", finish_and_watch)
    return refs


def optree_tensors(tree) -> list:
    import optree

    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _alive(refs) -> int:
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("mode", ["backward", "torch.func.grad"])
def test_kept_values_are_freed_as_soon_as_the_backward_through_them_ends(monkeypatch, mode):
    kept = _watch_kept_values(monkeypatch)
    step = remat(block, policy=policies.dots_saveable)
    alive_when_first_block_backward_starts = []

    def two_blocks(w1, w2):
        h = step(w1, X)
        h.register_hook(lambda g: alive_when_first_block_backward_starts.append((_alive(kept[0]), _alive(kept[1]))))
        return step(w2, h).square().mean()

    w1, w2 = WS[0].clone(), WS[1].clone()
    if mode == "backward":
        two_blocks(w1.requires_grad_(), w2.requires_grad_()).backward()
    else:
        tf.grad(two_blocks, argnums=(0, 1))(w1, w2)
    assert [len(k) for k in kept] == [2, 2]  # each block keeps its two matmuls
    # The second block's backward has ended, the first block's has not begun.
    assert alive_when_first_block_backward_starts == [(2, 0)]
    assert _alive(kept[0]) == 0


def test_retain_graph_keeps_them_for_the_second_backward(monkeypatch):
    kept = _watch_kept_values(monkeypatch)
    step = remat(block, policy=policies.dots_saveable)
    w = WS[0].clone().requires_grad_()
    loss_value = step(w, X).square().mean()
    (first,) = torch.autograd.grad(loss_value, w, retain_graph=True)
    assert _alive(kept[0]) == 2
    (second,) = torch.autograd.grad(loss_value, w)
    assert_close(first, second)
    assert _alive(kept[0]) == 0
