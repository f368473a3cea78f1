"""Random ops replay exactly during recomputation, and the caller's RNG never notices."""

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

from funckpt import remat

D = torch.float64
W = torch.randn(6, 6, dtype=D, generator=torch.Generator().manual_seed(7))
X = torch.randn(5, 6, dtype=D, generator=torch.Generator().manual_seed(8))


def noisy(w, x):
    h = torch.nn.functional.dropout(torch.tanh(x @ w), p=0.5)
    return h * torch.rand_like(h) + torch.randn_like(h).bernoulli_(0.5) * h


def loss(fn):
    return lambda w, x: fn(w, fn(w, x)).square().sum()


def seeded(run):
    torch.manual_seed(1234)
    out = run()
    return out, torch.get_rng_state()


@pytest.mark.parametrize("mode", ["grad", "vjp", "backward"])
def test_random_ops_replay_and_rng_state_after_equals_unremat(mode):
    def run(fn):
        if mode == "grad":
            return tf.grad(loss(fn))(W, X)
        if mode == "vjp":
            out, vjp_fn = tf.vjp(lambda w: fn(w, X), W)
            return vjp_fn(torch.ones_like(out))
        w = W.clone().requires_grad_()
        loss(fn)(w, X).backward()
        return w.grad

    expected, state_expected = seeded(lambda: run(noisy))
    got, state_got = seeded(lambda: run(remat(noisy)))
    assert_close(got, expected)
    assert torch.equal(state_got, state_expected)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_randomness_modes(randomness):
    def run(fn):
        return tf.vmap(tf.grad(lambda w, x: fn(w, x).sum()), in_dims=(None, 0), randomness=randomness)(W, X)

    expected, state_expected = seeded(lambda: run(noisy))
    got, state_got = seeded(lambda: run(remat(noisy)))
    assert_close(got, expected)
    assert torch.equal(state_got, state_expected)


def test_vmap_randomness_error_raises_as_torch_func_does():
    with pytest.raises(RuntimeError, match="randomness"):
        tf.vmap(remat(noisy), in_dims=(None, 0))(W, X)


def test_preserve_rng_state_false_does_not_replay():
    expected, _ = seeded(lambda: tf.grad(loss(noisy))(W, X))
    got, _ = seeded(lambda: tf.grad(loss(remat(noisy, preserve_rng_state=False)))(W, X))
    assert not torch.allclose(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generator_replays():
    w, x = W.cuda(), X.cuda()
    expected, _ = seeded(lambda: tf.grad(loss(noisy))(w, x))
    got, _ = seeded(lambda: tf.grad(loss(remat(noisy)))(w, x))
    assert_close(got, expected)
