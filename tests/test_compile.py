"""remat inside torch.compile: a graph break, correct gradients, memory still saved.

A remat'd call is ``torch.compiler.disable``d: Dynamo compiles the code around
it and the region (forward, recomputation, vjp) runs eagerly. Every test compares
against the same program without remat, run eagerly.

``aot_eager`` exercises Dynamo and AOTAutograd without code generation, so it
covers most cases; ``inductor`` (code generation, a C++ compiler on CPU: about 40 s
on a cold cache) is tested on the two cases users hit first.
"""

import pytest
import torch
import torch._dynamo
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

from benchmarks._common import held_bytes
from funckpt import checkpoint, checkpoint_name, checkpoint_sequential, policies, remat

D = 8


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_name(self.up(self.ln(x)), "up")
        return x + self.down(F.dropout(F.gelu(h), 0.1, self.training))


class Net(nn.Module):
    def __init__(self, depth: int = 3, wrap=lambda b: b) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(wrap(Block()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.sin().sum()


def _nets(wrap, depth: int = 3) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = Net(depth).double()
    rematted = Net(depth, wrap).double()
    rematted.load_state_dict(plain.state_dict())
    return plain, rematted


def _grads(net: nn.Module, x: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    net(x).backward()
    return [x.grad, *(p.grad for p in net.parameters())]


def _assert_same_backward(wrap, backend: str, x: torch.Tensor | None = None) -> None:
    plain, rematted = _nets(wrap)
    x = torch.randn(5, D, dtype=torch.double) if x is None else x
    compiled = torch.compile(rematted, backend=backend)
    for _ in range(2):  # the second call runs the cached graphs
        torch.testing.assert_close(_grads(compiled, x), _grads(plain, x))


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(remat, id="remat(module)"),
        pytest.param(lambda b: remat(b, policy=policies.dots_saveable), id="dots_saveable"),
        pytest.param(lambda b: remat(b, policy=policies.save_only_these_names("up")), id="names"),
    ],
)
def test_remat_blocks_in_a_compiled_model_give_eager_gradients_with_aot_eager(wrap):
    _assert_same_backward(wrap, "aot_eager")


def test_remat_blocks_in_a_compiled_model_give_eager_gradients_with_inductor():
    _assert_same_backward(remat, "inductor")


def test_dropout_inside_remat_replays_under_inductor():
    plain, rematted = _nets(remat)
    plain.train(), rematted.train()
    x = torch.randn(5, D, dtype=torch.double)
    compiled = torch.compile(rematted, backend="inductor")
    torch.testing.assert_close(_grads(compiled, x, seed=3), _grads(plain, x, seed=3))


def test_remat_function_between_compiled_code_gives_eager_gradients():
    w = torch.randn(D, D, dtype=torch.double, requires_grad=True)

    def block(x):
        return torch.tanh(x @ w) @ w.T

    def program(block_fn, x):
        return (block_fn(x.cos() * 2) + x).sin().sum()

    x = torch.randn(4, D, dtype=torch.double, requires_grad=True)
    expected = torch.autograd.grad(program(block, x), (x, w))
    compiled = torch.compile(program, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(remat(block), x), (x, w)), expected)


def test_checkpoint_and_checkpoint_sequential_inside_compile():
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))).double()
    x = torch.randn(3, D, dtype=torch.double, requires_grad=True)
    expected = torch.autograd.grad(seq(x).sum(), (x, *seq.parameters()))

    def with_checkpoint(x):
        return checkpoint(seq, x, use_reentrant=False).sum()

    def with_sequential(x):
        return checkpoint_sequential(seq, 2, x, use_reentrant=False).sum()

    for program in (with_checkpoint, with_sequential):
        out = torch.compile(program, backend="aot_eager")(x)
        torch.testing.assert_close(torch.autograd.grad(out, (x, *seq.parameters())), expected)


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda f: tf.grad(f), id="grad"),
        pytest.param(lambda f: tf.vmap(tf.grad(f)), id="vmap(grad)"),
        pytest.param(lambda f: tf.jacrev(tf.grad(f)), id="hessian"),
    ],
)
def test_compiled_torch_func_transforms_of_remat(transform):
    w = torch.randn(D, D, dtype=torch.double)

    def loss(block_fn):
        return lambda x: block_fn(x).sin().sum()

    def block(x):
        return torch.tanh(x @ w)

    x = torch.randn(3, D, dtype=torch.double)
    expected = transform(loss(block))(x)
    compiled = torch.compile(transform(loss(remat(block))), backend="aot_eager")
    torch.testing.assert_close(compiled(x), expected)


def test_compiled_function_inside_remat_is_correct():
    """Correct, though Dynamo may run ``f`` eagerly while funckpt's modes are active."""
    w = torch.randn(D, D, dtype=torch.double, requires_grad=True)

    def block(x):
        return torch.tanh(x @ w) @ w.T

    x = torch.randn(4, D, dtype=torch.double, requires_grad=True)
    inner = remat(torch.compile(block, backend="aot_eager"))
    expected = torch.autograd.grad(block(x).sin().sum(), (x, w))
    torch.testing.assert_close(torch.autograd.grad(inner(x).sin().sum(), (x, w)), expected)
    expected = tf.grad(lambda x: block(x).sin().sum())(x)
    torch.testing.assert_close(tf.grad(lambda x: inner(x).sin().sum())(x), expected)


def test_each_remat_call_is_a_graph_break_and_the_code_between_is_compiled():
    w = torch.randn(D, D, dtype=torch.double, requires_grad=True)
    plain = lambda x: torch.tanh(x @ w)  # noqa: E731
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def program(x, block):
        y = block(x.cos())
        z = block(y.sin())
        return z.exp().sum()

    x = torch.randn(4, D, dtype=torch.double, requires_grad=True)
    out = torch.compile(program, backend=counting_backend)(x, remat(plain))
    assert len(graphs) == 3  # cos | remat | sin | remat | exp, sum
    expected = torch.autograd.grad(program(x, plain), x)
    torch.testing.assert_close(torch.autograd.grad(out, x), expected)


def test_fullgraph_compile_refuses_remat_with_a_reason():
    w = torch.randn(D, D)
    f = remat(lambda x: torch.tanh(x @ w))
    with pytest.raises(Exception, match="funckpt.remat runs eagerly under torch.compile"):
        torch.compile(lambda x: f(x).sum(), backend="aot_eager", fullgraph=True)(torch.randn(2, D))


def test_remat_keeps_only_block_inputs_inside_a_compiled_model():
    torch.manual_seed(0)
    plain, rematted = _nets(remat, depth=4)
    plain.float(), rematted.float()
    x = torch.randn(256, D)
    compiled_plain = torch.compile(plain, backend="aot_eager")
    compiled_remat = torch.compile(rematted, backend="aot_eager")
    compiled_plain(x), compiled_remat(x)  # compile outside the measurement
    kept_plain = held_bytes(lambda: compiled_plain(x))
    kept_remat = held_bytes(lambda: compiled_remat(x))
    assert kept_remat < 0.4 * kept_plain, (kept_remat, kept_plain)
