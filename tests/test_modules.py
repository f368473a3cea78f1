"""remat(module) is an nn.Module that stands in for the module it wraps."""

import torch
import torch.func as tf
from torch.testing import assert_close

from funckpt import remat

D = torch.float64


def _net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=D), torch.nn.GELU(), torch.nn.Linear(8, 4, dtype=D))


def test_wrapper_is_a_module_with_the_original_keys():
    net = _net()
    wrapped = remat(net)
    assert isinstance(wrapped, torch.nn.Module)
    assert list(wrapped.state_dict()) == list(net.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in net.named_parameters()]
    wrapped.load_state_dict(_net().state_dict())
    assert_close(wrapped.state_dict(), net.state_dict())


def test_wrapper_as_submodule_keeps_prefixed_keys_and_gradients():
    inner = _net()
    outer = torch.nn.Sequential(remat(inner), torch.nn.Tanh())
    reference = torch.nn.Sequential(inner, torch.nn.Tanh())
    assert list(outer.state_dict()) == list(reference.state_dict())
    x = torch.randn(3, 4, dtype=D)
    params = dict(reference.named_parameters())
    loss = lambda m: (lambda p: tf.functional_call(m, p, (x,)).square().sum())  # noqa: E731
    assert_close(tf.grad(loss(outer))(params), tf.grad(loss(reference))(params))


def test_train_and_eval_reach_the_wrapped_module():
    net = torch.nn.Dropout(0.5)
    wrapped = remat(net)
    wrapped.eval()
    assert not net.training
    wrapped.train()
    assert net.training
