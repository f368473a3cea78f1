"""No leaks across steps, and concurrent use from several threads."""

import threading

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
