"""saved_residuals lists what remat'd calls keep between the forward and the backward pass."""

import torch

import funckpt
from funckpt import checkpoint_name, policies, remat


def block(w, x, *, bias):
    h = checkpoint_name(torch.tanh(x @ w + bias), "hidden")
    return h @ w.T


W = torch.randn(8, 8, requires_grad=True)
B = torch.zeros(8, requires_grad=True)
X = torch.randn(4, 8)


def test_default_policy_keeps_only_inputs_with_their_paths():
    rs = funckpt.saved_residuals(remat(block), W, X, bias=B)
    assert [(r.kind, r.source, r.shape) for r in rs] == [
        ("input", "args[0]", (8, 8)),
        ("input", "args[1]", (4, 8)),
        ("input", "kwargs['bias']", (8,)),
    ]
    assert all(r.region == "block" and r.nbytes == r.dtype.itemsize * torch.Size(r.shape).numel() for r in rs)


def test_policy_saved_values_name_their_operator_and_name():
    rs = funckpt.saved_residuals(remat(block, policy=policies.save_only_these_names("hidden")), W, X, bias=B)
    saved = [r for r in rs if r.kind == "saved by policy"]
    assert [(r.source, r.shape) for r in saved] == [("aten.tanh.default named 'hidden'", (4, 8))]


def test_module_parameters_are_listed_by_name(capsys):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    rs = funckpt.saved_residuals(remat(lambda x: net(x)), X)
    assert {r.source for r in rs} == {"args[0]", "parameter/buffer '0.weight'", "parameter/buffer '0.bias'"}
    funckpt.print_saved_residuals(remat(lambda x: net(x)), X)
    printed = capsys.readouterr().out
    assert "parameter/buffer '0.weight'" in printed and "total:" in printed


def test_every_remat_call_inside_a_bigger_function_is_listed():
    step = remat(block)

    def model(x):
        return step(W, step(W, x, bias=B), bias=B).sum()

    rs = funckpt.saved_residuals(model, X)
    assert len(rs) == 6 and {r.region for r in rs} == {"block"}
