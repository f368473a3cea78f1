"""Gradients reach tensors the function uses without receiving them, or remat raises."""

import functools
import logging
import math
import operator
import types

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

from funckpt import CheckpointError, checkpoint, checkpoint_name, policies, remat

D = torch.float64
X = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(3))
GLOBAL_W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(4)).requires_grad_()


class Holder:
    """Class attributes are not walked: a tensor here is unreachable for remat."""

    w = torch.randn(4, 4, dtype=D).requires_grad_()


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=D), torch.nn.Tanh(), torch.nn.Linear(8, 4, dtype=D))


def _backward_grads(fn, params):
    for p in params:
        p.grad = None
    fn().square().sum().backward()
    return [p.grad.clone() for p in params]


def test_module_as_fn_backward_and_functional_call():
    net = _mlp()
    params = list(net.parameters())
    expected = _backward_grads(lambda: net(X), params)
    assert_close(_backward_grads(lambda: remat(net)(X), params), expected)

    named = dict(net.named_parameters())
    loss = lambda p, f: tf.functional_call(f, p, (X,)).square().sum()  # noqa: E731
    # functional_call swaps parameters into the module only during the call; the
    # recomputation happens after it has restored them.
    assert_close(tf.grad(lambda p: loss(p, remat(net)))(named), tf.grad(lambda p: loss(p, net))(named))


def test_bound_method_of_module():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, dtype=D)

        def features(self, x):
            return torch.tanh(self.lin(x))

    net = Net()
    params = list(net.parameters())
    expected = _backward_grads(lambda: net.features(X), params)
    assert_close(_backward_grads(lambda: remat(net.features)(X), params), expected)


def test_partial_arguments():
    w = torch.randn(4, 4, dtype=D)

    def f(w, x):
        return torch.tanh(x @ w)

    got = tf.grad(lambda w: remat(functools.partial(f, w))(X).sum())(w)
    assert_close(got, tf.grad(lambda w: f(w, X).sum())(w))


def test_closure_over_tensor_under_grad_and_backward():
    w = torch.randn(4, 4, dtype=D)

    def loss(w, wrap):
        def inner(x):
            return torch.tanh(x @ w) @ w

        return wrap(inner)(X).square().sum()

    # the silently-zero case of a naive implementation
    assert_close(tf.grad(lambda w: loss(w, remat))(w), tf.grad(lambda w: loss(w, lambda f: f))(w))
    wl = w.clone().requires_grad_()
    loss(wl, remat).backward()
    assert wl.grad is not None
    assert_close(wl.grad, tf.grad(lambda w: loss(w, lambda f: f))(w))


def test_closure_over_module_and_nested_closure_and_containers():
    net = _mlp()
    scale = torch.tensor(2.0, dtype=D, requires_grad=True)
    table = {"shift": torch.zeros(4, dtype=D, requires_grad=True)}

    def helper(h):
        return h * scale + table["shift"]

    def f(x):
        return helper(net(x))

    params = [*net.parameters(), scale, table["shift"]]
    expected = _backward_grads(lambda: f(X), params)
    assert_close(_backward_grads(lambda: remat(f)(X), params), expected)


def test_global_tensor():
    def f(x):
        return torch.tanh(x @ GLOBAL_W)

    expected = _backward_grads(lambda: f(X), [GLOBAL_W])
    assert_close(_backward_grads(lambda: remat(f)(X), [GLOBAL_W]), expected)


def test_default_argument_tensor():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def f(x, w=w):
        return torch.tanh(x @ w)

    expected = _backward_grads(lambda: f(X), [w])
    assert_close(_backward_grads(lambda: remat(f)(X), [w]), expected)


def test_unreachable_tensor_raises_under_backward():
    def f(x):
        return x @ Holder.w

    with pytest.raises(CheckpointError, match="Pass the tensor to the remat'd function as an argument"):
        remat(f)(X)


def test_unreachable_tensor_written_by_nn_init_is_refused_as_unreachable():
    """nn.init returns the tensor it wrote: one the function did not make stays unreachable, and its
    use is refused as such (not as a leaf the function made to require grad itself)."""

    def f(x):
        with torch.no_grad():
            torch.nn.init.normal_(Holder.w)
        return x @ Holder.w

    w_was = Holder.w.detach().clone()
    try:
        with pytest.raises(CheckpointError, match="Pass the tensor to the remat'd function as an argument"):
            remat(f)(X)
    finally:
        with torch.no_grad():
            Holder.w.copy_(w_was)


def test_unreachable_tensor_raises_under_torch_func_grad():
    def outer(w):
        Holder.current = w  # reachable only through a class attribute

        def f(x):
            return x @ Holder.current

        return remat(f)(X).sum()

    with pytest.raises(CheckpointError, match="enclosing torch.func transform"):
        tf.grad(outer)(torch.randn(4, 4, dtype=D))


def test_closure_cell_rebound_between_forward_and_backward_raises():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def f(x):
        return torch.tanh(x @ w)

    y = remat(f)(X)
    w = torch.randn(4, 4, dtype=D, requires_grad=True)  # noqa: F841 - rebinds f's cell
    with pytest.raises(CheckpointError, match="was rebound"):
        y.sum().backward()


SCALE = 2.0  # a number the module below reads as a global: nothing to route
MODULE_GLOBAL_W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(8)).requires_grad_()


class _ReadsGlobals(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x @ MODULE_GLOBAL_W) * SCALE


def test_global_of_a_modules_forward_rebound_between_forward_and_backward_raises():
    global MODULE_GLOBAL_W
    before = MODULE_GLOBAL_W
    y = remat(_ReadsGlobals())(X)
    MODULE_GLOBAL_W = torch.randn(4, 4, dtype=D, requires_grad=True)
    try:
        with pytest.raises(CheckpointError, match="was rebound"):
            y.sum().backward()
    finally:
        MODULE_GLOBAL_W = before


def test_global_number_of_a_modules_forward_is_no_capture():
    net = _ReadsGlobals()
    y = remat(net)(X)
    expected = torch.autograd.grad(net(X).sum(), MODULE_GLOBAL_W)
    assert_close(torch.autograd.grad(y.sum(), MODULE_GLOBAL_W), expected)


# A module of the user's own (``import params``; ``params.W`` in the function), made here rather than
# imported: what the function reads off it is routed as a global is.
user_params = types.ModuleType("user_params")
user_params.W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(11)).requires_grad_()
user_params.tables = types.ModuleType("user_params.tables")
user_params.tables.shift = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(12)).requires_grad_()
user_params.holder = types.SimpleNamespace(scale=torch.tensor(1.5, dtype=D, requires_grad=True))


def _helper_of_user_params(h):
    return h * user_params.holder.scale


user_params.helper = _helper_of_user_params  # (a function of the user's, reached through the module too)


def _reads_a_user_module(x):
    return user_params.helper(torch.tanh(x @ user_params.W) + user_params.tables.shift)


def _reads_a_user_module_through_its_closure():
    params = user_params  # (``import params`` inside the enclosing function: a closure variable)

    def f(x):
        return params.helper(torch.tanh(x @ params.W) + params.tables.shift)

    return f


_USER_PARAMS = [user_params.W, user_params.tables.shift, user_params.holder.scale]


@pytest.mark.parametrize("route", ["global", "closure"])
def test_tensors_read_off_a_python_module_of_the_users_get_their_gradients(route):
    """``import params; params.W`` in the function: the tensors the code reads off a Python module
    (a global or closure variable, through a submodule, an object or a function of that module) get
    their gradients, as without remat, instead of a CheckpointError saying they are unreachable."""
    f = _reads_a_user_module if route == "global" else _reads_a_user_module_through_its_closure()
    expected = _backward_grads(lambda: f(X), _USER_PARAMS)
    assert_close(_backward_grads(lambda: remat(f)(X), _USER_PARAMS), expected)
    assert_close(tf.grad(lambda x: remat(f)(x).sum())(X), tf.grad(lambda x: f(x).sum())(X))


def test_a_tensor_of_a_users_python_module_rebound_between_forward_and_backward_raises():
    before = user_params.W
    y = remat(_reads_a_user_module)(X)
    user_params.W = torch.randn(4, 4, dtype=D, requires_grad=True)
    try:
        with pytest.raises(CheckpointError, match="was rebound"):
            y.sum().backward()
    finally:
        user_params.W = before


class _KeepsParametersOutsideItsRegistries(torch.nn.Module):
    """Tensors and modules its forward differentiates, kept where nn.Module does not register them:
    an unregistered list or dict of parameters, a shared layer set with ``object.__setattr__`` (so
    that it is neither saved twice nor counted twice), or in a list."""

    def __init__(self, kept):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.kept = kept
        if kept == "hidden module":
            object.__setattr__(self, "shared", torch.nn.Linear(4, 4, dtype=D))
        elif kept == "module in a list":
            self.shared = [torch.nn.Linear(4, 4, dtype=D)]
        elif kept == "list of parameters":
            self.ws = [torch.nn.Parameter(torch.randn(4, 4, dtype=D)), torch.nn.Parameter(torch.randn(4, dtype=D))]
        else:
            self.ws = {"w": torch.nn.Parameter(torch.randn(4, 4, dtype=D)), "b": torch.nn.Parameter(torch.randn(4, dtype=D))}
        self.outputs = []  # (activations kept by the module itself: not entered, not routed)

    def outside(self):
        if self.kept == "hidden module":
            return list(self.shared.parameters())
        if self.kept == "module in a list":
            return list(self.shared[0].parameters())
        return list(self.ws.values() if isinstance(self.ws, dict) else self.ws)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.kept == "hidden module":
            y = self.shared(h)
        elif self.kept == "module in a list":
            y = self.shared[0](h)
        elif self.kept == "list of parameters":
            y = h @ self.ws[0] + self.ws[1]
        else:
            y = h @ self.ws["w"] + self.ws["b"]
        self.outputs.append(y.detach())
        return y.sin()


_KEPT_OUTSIDE = ["hidden module", "module in a list", "list of parameters", "dict of parameters"]


@pytest.mark.parametrize("kept", _KEPT_OUTSIDE)
def test_tensors_a_module_keeps_outside_its_registries_get_their_gradients(kept):
    """A layer's parameters kept outside nn.Module's registries (unregistered lists and dicts, a shared
    layer hidden with ``object.__setattr__``) get their gradients through ``remat(module)``, as
    without remat, instead of a CheckpointError saying they are unreachable; under ``torch.func``
    the registered ones, passed to ``functional_call``, get theirs."""
    torch.manual_seed(0)
    net = _KeepsParametersOutsideItsRegistries(kept)
    params = [*net.parameters(), *net.outside()]
    expected = _backward_grads(lambda: net(X), params)
    for _ in range(2):  # (the second step finds the first's kept activations, and leaves them)
        assert_close(_backward_grads(lambda: remat(net)(X), params), expected)
    named = {k: v.detach() for k, v in net.named_parameters()}
    loss = lambda p, x, f: tf.functional_call(f, p, (x,)).square().sum()  # noqa: E731
    assert_close(tf.grad(loss, argnums=(0, 1))(named, X, remat(net)), tf.grad(loss, argnums=(0, 1))(named, X, net))


class _Holds(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer, self.head = layer, torch.nn.Linear(4, 4, dtype=D)

    def forward(self, x):
        return self.head(self.layer(x))


class _PlainTensorAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.scale = torch.randn(4, dtype=D).requires_grad_()  # (not a Parameter: a plain attribute)

    def outside(self):
        return [self.scale]

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


@pytest.mark.parametrize("wrappers", [1, 2])
@pytest.mark.parametrize("kept", [*_KEPT_OUTSIDE, "plain tensor attribute"])
def test_what_a_remat_layer_keeps_outside_its_registries_is_found_by_an_enclosing_remat(kept, wrappers):
    """``remat(model)`` holding ``remat(layer)`` (or ``remat(remat(layer))``, a library's wrapper,
    then the user's): each wrapper shares the layer's registries, and what the layer keeps
    besides (its own attributes) is walked as the wrapper's, so the enclosing call routes it (a
    false "neither an argument nor reachable", or "not routed", error before)."""
    torch.manual_seed(0)
    layer = _PlainTensorAttribute() if kept == "plain tensor attribute" else _KeepsParametersOutsideItsRegistries(kept)
    wrapped = remat(layer) if wrappers == 1 else remat(remat(layer))
    plain, nested = _Holds(layer), _Holds(wrapped)
    nested.head = plain.head
    params = [*plain.parameters(), *layer.outside()]
    expected = _backward_grads(lambda: plain(X), params)
    assert_close(_backward_grads(lambda: remat(nested)(X), params), expected)
    named = {k: v.detach() for k, v in plain.named_parameters()}
    loss = lambda p, x, f: tf.functional_call(f, p, (x,)).square().sum()  # noqa: E731
    assert_close(tf.grad(loss, argnums=(0, 1))(named, X, remat(nested)), tf.grad(loss, argnums=(0, 1))(named, X, plain))


@pytest.mark.parametrize("kept", _KEPT_OUTSIDE)
def test_what_a_module_keeps_outside_its_registries_is_found_with_or_without_the_walk(kept, monkeypatch):
    """The shortcut for a module whose forward reaches nothing (the walk of its state alone) finds
    what it keeps outside its registries as the walk does."""
    from funckpt import _capture

    net = _KeepsParametersOutsideItsRegistries(kept)
    told = _found(_capture.find_captured(net))
    assert {id(t) for t in net.outside()} <= set(told[0])
    monkeypatch.setattr(_capture, "_reaches_nothing", lambda fn: False)
    assert told == _found(_capture.find_captured(net))


class _KeepsItsInputInAContainer(torch.nn.Module):
    def __init__(self, kept):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.kept = {} if kept == "dict" else []

    def forward(self, x):
        if isinstance(self.kept, dict):
            self.kept["input"] = x  # (for inspection, as a debugging hook keeps it)
        else:
            self.kept[:] = [x]
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("kept", ["dict", "list"])
def test_an_input_a_module_kept_from_a_call_under_a_transform_is_not_entered(kept):
    """A module keeping its input in a list or dict of its own: after a call under ``vmap`` (or
    ``grad``), that holds a functorch wrapper of a transform that has ended. The next call's walk
    does not enter the container (routed, the wrapper's ``detach()`` raised functorch's "your tensor
    may have escaped" RuntimeError); calls in one transform, under ``.backward()`` too, match."""
    net = _KeepsItsInputInAContainer(kept)
    once = lambda m: lambda x: m(x).sum()  # noqa: E731
    twice = lambda m: lambda x: m(m(x) * 1.5).sum()  # noqa: E731
    for f in (once, twice):
        expected = tf.vmap(tf.grad(f(net)))(X), tf.grad(f(net))(X)
        tf.vmap(tf.grad(f(net)))(X)  # (the input of a call under vmap kept)
        assert_close(tf.grad(f(remat(net)))(X), expected[1])
        assert_close(tf.vmap(tf.grad(f(remat(net))))(X), expected[0])
        params = [*net.parameters()]
        grads = _backward_grads(lambda: net(X), params)
        tf.vmap(tf.grad(f(net)))(X)
        assert_close(_backward_grads(lambda: remat(net)(X), params), grads)


def test_a_list_of_parameters_a_module_keeps_reordered_between_forward_and_backward_raises():
    net = _KeepsParametersOutsideItsRegistries("list of parameters")
    net.ws.append(torch.nn.Parameter(torch.randn(4, 4, dtype=D)))
    y = remat(net)(X)
    net.ws[0], net.ws[2] = net.ws[2], net.ws[0]
    with pytest.raises(CheckpointError, match="ws"):
        y.sum().backward()


def test_lists_of_a_modules_own_registered_parameters_are_no_places_to_record():
    """``nn.LSTM``'s ``_flat_weights`` list, a tied alias list, a registered layer also set with
    ``object.__setattr__``: what they hold the registries hold, by name. They are not kept outside
    the registries, so no call records where their tensors sit (which costs each call), and the
    gradients are those without remat."""
    from funckpt import _capture

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, dtype=D)
            self.ws = [self.lin.weight]
            object.__setattr__(self, "alias", self.lin)

        def forward(self, x):
            return self.alias(x) @ self.ws[0]

    torch.manual_seed(0)
    lstm, tied = torch.nn.LSTM(4, 5, num_layers=2, dtype=D), Tied()
    for net, x in ((lstm, torch.randn(3, 2, 4, dtype=D)), (tied, X)):
        assert _capture.find_captured(net, record_places=True).at_places is None
        out = (lambda m: m(x)[0]) if net is lstm else (lambda m: m(x))
        params = list(net.parameters())
        assert_close(_backward_grads(lambda: out(remat(net)), params), _backward_grads(lambda: out(net), params))


def test_what_a_function_reads_off_an_installed_package_is_not_followed():
    """Only the user's own Python modules are followed (``params.W``): an installed package's
    (transformers, reached as ``transformers.activations.ACT2FN`` in a model's code) is library code,
    whose objects the walk would otherwise enter on every call."""
    transformers = pytest.importorskip("transformers")
    from funckpt import _capture

    import transformers.activations  # noqa: F401

    assert not _capture._is_users_module(transformers.activations)
    assert _capture._is_users_module(user_params)

    def f(x):
        return transformers.activations.ACT2FN["gelu"](x)

    assert _capture.module_reads(f) == []


class _RefersToItsModel(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.how = how

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _ModelOfBlocksReferringToIt(torch.nn.Module):
    def __init__(self, how, wrap):
        super().__init__()
        self.first = torch.nn.Linear(4, 4, dtype=D)
        self.blocks = torch.nn.ModuleList()
        for _ in range(2):
            block = _RefersToItsModel(how)
            if how == "hidden":
                object.__setattr__(block, "root", self)
            else:
                block.root = [self]  # (a list: registered neither)
            self.blocks.append(remat(block) if wrap else block)

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("how", ["hidden", "in a list"])
def test_a_back_reference_to_the_model_a_layer_sits_in_is_not_entered(how):
    """A layer keeping a reference to the model it sits in, outside the registries (a navigation
    aid): that is where the layer sits, not what it keeps, and the walk of the layer does not enter
    it. Entered, each layer's call routed the whole model's tensors, and refused the model's other
    FSDP-managed layers as called in it (a false CheckpointError: tests/test_distributed.py)."""
    from funckpt import _capture

    torch.manual_seed(0)
    net = _ModelOfBlocksReferringToIt(how, wrap=False)
    for block in net.blocks:
        assert _found(_capture.find_captured(block))[0] == [id(t) for t in block.parameters()]
    torch.manual_seed(0)
    rematted = _ModelOfBlocksReferringToIt(how, wrap=True)
    expected = _backward_grads(lambda: net(X), list(net.parameters()))
    assert_close(_backward_grads(lambda: rematted(X), list(rematted.parameters())), expected)
    named = {k: v.detach() for k, v in rematted.named_parameters()}
    loss = lambda p, x, f: tf.functional_call(f, p, (x,)).square().sum()  # noqa: E731
    assert_close(tf.grad(loss)(named, X, rematted), tf.grad(loss)(named, X, net))


_CYCLE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # (a walk without end fails here, not the machine)
import torch
from funckpt import CheckpointError, remat
net = torch.nn.Sequential(torch.nn.Linear(4, 4))
net[0].parent = net  # (registered: a cycle of submodules)
try:
    remat(net)(torch.randn(2, 4))
except CheckpointError as e:
    print(e)
"""


def test_a_cycle_of_submodules_is_refused_not_walked_without_end():
    """A module registered as a submodule of its own submodule: the walk of the submodules stops at
    Python's recursion limit with a CheckpointError, as named_modules' recursion stopped, instead of
    growing its stack until memory runs out."""
    import os
    import subprocess
    import sys

    pytest.importorskip("resource")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _CYCLE], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "recursion limit" in done.stdout and "0.parent.0.parent" in done.stdout


def test_constant_captured_tensors_and_integer_inputs_get_no_gradient():
    mask = torch.tensor([True, False, True, True])
    idx = torch.tensor([2, 0, 1])

    def f(w, x, idx):
        return (torch.tanh(x @ w) * mask)[idx]

    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    x = X.clone()  # needs no grad
    remat(f)(w, x, idx).sum().backward()
    assert x.grad is None and idx.grad is None
    w_ref = w.detach().clone().requires_grad_()
    f(w_ref, x, idx).sum().backward()
    assert_close(w.grad, w_ref.grad)


def test_fn_may_use_torch_func_internally():
    def f(w, x):
        g = tf.grad(lambda v: torch.tanh(x @ v).sum())(w)
        return g * w

    w = torch.randn(4, 4, dtype=D)
    assert_close(tf.grad(lambda w: remat(f)(w, X).sum())(w), tf.grad(lambda w: f(w, X).sum())(w))
    wl = w.clone().requires_grad_()
    remat(f)(wl, X).sum().backward()
    assert_close(wl.grad, tf.grad(lambda w: f(w, X).sum())(w))


def test_fn_may_use_a_custom_autograd_function():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    def f(w, x):
        return Square.apply(torch.tanh(x @ w)).sin()

    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    remat(f)(w, X).sum().backward()
    w_ref = w.detach().clone().requires_grad_()
    f(w_ref, X).sum().backward()
    assert_close(w.grad, w_ref.grad)


def test_fn_may_differentiate_its_own_intermediates_and_nest_checkpoints_with_grad_enabled():
    def f(x):
        with torch.enable_grad():
            y = remat(torch.sin)(x)  # an autograd.Function output made inside
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return g * x

    x = X.clone().requires_grad_()
    remat(f)(x).sum().backward()
    x_ref = X.clone().requires_grad_()
    f(x_ref).sum().backward()
    assert_close(x.grad, x_ref.grad)


def test_closure_tensor_passed_straight_to_a_custom_function_raises():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    w = torch.tensor([[1.0], [2.0]], dtype=D, requires_grad=True)
    x = torch.tensor([[0.5, -1.0]], dtype=D)
    with pytest.raises(CheckpointError, match="custom autograd.Function"):
        remat(lambda x: torch.tanh(x @ Double.apply(w)))(x)
    with pytest.raises(CheckpointError):
        tf.grad(lambda w: remat(lambda x: torch.tanh(x @ Double.apply(w)))(x).sum())(w.detach())


def test_unreachable_forward_mode_dual_raises():
    import torch.autograd.forward_ad as fwAD

    class Holder:  # class attributes are not walked
        pass

    with fwAD.dual_level():
        Holder.weight = fwAD.make_dual(torch.tensor([1.0, 2.0], dtype=D), torch.ones(2, dtype=D))
        with pytest.raises(CheckpointError, match="forward-mode tangent"):
            remat(lambda x: (x * Holder.weight).sin())(torch.tensor([0.5, 1.0], dtype=D))


def test_tensors_in_slots_and_behind_weak_proxies():
    import weakref

    class Slots:
        __slots__ = ("w", "p")

    w = torch.randn(3, dtype=D, requires_grad=True)
    kept = torch.randn(3, dtype=D)
    s = Slots()
    s.w, s.p = w, weakref.proxy(kept)  # a proxy is skipped: it keeps nothing alive

    def f(x, s):
        return (x * s.w).sin().sum()

    x = torch.ones(3, dtype=D)
    assert_close(torch.autograd.grad(remat(f)(x, s), w), torch.autograd.grad(f(x, s), w))
    assert_close(torch.autograd.grad(remat(lambda x: f(x, s))(x), w), torch.autograd.grad(f(x, s), w))

    class OneSlot:
        __slots__ = "w"  # a string, not a tuple: one slot named "w"

    one = OneSlot()
    one.w = w
    assert_close(torch.autograd.grad(remat(f)(x, one), w), torch.autograd.grad(f(x, one), w))


weight = torch.zeros(1)  # a global sharing its name with an attribute used below


def test_attribute_names_are_not_mistaken_for_globals():
    from funckpt._capture import find_captured

    net = torch.nn.Linear(4, 4, dtype=D)

    def f(x):
        return x @ net.weight.T

    assert all(t is not weight for t in find_captured(f).tensors)


def test_a_module_passed_as_an_argument_has_its_parameters_routed():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()).double()
    x = torch.randn(2, 3, dtype=torch.double, requires_grad=True)

    def f(x, m):
        return m(x).sin().sum()

    expected = torch.autograd.grad(f(x, net), (x, *net.parameters()))
    assert_close(torch.autograd.grad(remat(f)(x, net), (x, *net.parameters())), expected)

    class Apply(torch.nn.Module):  # passes its submodule to the remat'd function
        def __init__(self, net, fn):
            super().__init__()
            self.net, self.fn = net, fn

        def forward(self, x):
            return self.fn(x, self.net)

    params = {f"net.{k}": v.detach() for k, v in net.named_parameters()}
    grads = tf.grad(lambda p: tf.functional_call(Apply(net, f), p, (x.detach(),)))(params)
    assert_close(tf.grad(lambda p: tf.functional_call(Apply(net, remat(f)), p, (x.detach(),)))(params), grads)


class _Box:
    """A container optree does not know."""

    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize("static", [False, True])
def test_tensors_and_modules_inside_unflattened_arguments_are_routed(static):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    w = torch.randn(3, dtype=torch.double, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.double, requires_grad=True)

    def f(x, box):
        return torch.tanh(box.t[0](x) * box.t[1]).sum()

    def call(fn):
        return fn(x, _Box([lin, w]))

    wrapped = remat(f, static_argnums=1) if static else remat(f)
    wrt = (x, w, *lin.parameters())
    assert_close(torch.autograd.grad(call(wrapped), wrt), torch.autograd.grad(call(f), wrt))
    grads = tf.grad(lambda w: wrapped(x.detach(), _Box([lin, w])))(w.detach())
    assert_close(grads, tf.grad(lambda w: f(x.detach(), _Box([lin, w])))(w.detach()))


def test_walking_a_large_argument_object_is_bounded():
    """The walk stops after a fixed number of items, numbers included (it visited a million)."""
    looked_at = []

    class Sentinel:
        def __getattribute__(self, name):
            looked_at.append(name)
            return object.__getattribute__(self, name)

    class Config:
        pass

    config = Config()
    config.table = [list(range(1000)) for _ in range(998)] + [[*range(1000), Sentinel()]]  # after a million ints
    x = torch.randn(3, dtype=D, requires_grad=True)
    y = remat(lambda x, c: x.sin().sum())(x, config)
    assert_close(torch.autograd.grad(y, x), (x.cos(),))
    assert looked_at == []


LOGGER = logging.getLogger("funckpt.tests.capture")


def test_a_logger_the_code_names_is_not_walked():
    """A module-level logger reaches the logging manager and every logger of the process
    (a Hugging Face layer's forward names its module's): the walk does not enter it."""
    looked_at = []

    class Sentinel:
        def __getattribute__(self, name):
            looked_at.append(name)
            return object.__getattribute__(self, name)

    LOGGER.sentinel = Sentinel()
    try:

        def f(x):
            LOGGER.debug("running f")
            return x.sin()

        x = torch.randn(3, dtype=D, requires_grad=True)
        assert_close(torch.autograd.grad(remat(f)(x).sum(), x), (x.cos(),))
    finally:
        del LOGGER.sentinel
    assert looked_at == []


def test_a_tensor_reached_only_through_a_standard_library_object_is_refused_not_dropped():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    LOGGER.w = w
    try:
        with pytest.raises(CheckpointError, match="Pass the tensor to the remat'd function as an argument"):
            remat(lambda x: x @ LOGGER.w)(X).sum().backward()
    finally:
        del LOGGER.w


def test_a_tensor_behind_a_functools_cache_is_routed():
    """Other standard-library objects are walked like any object: an lru_cache wrapper leads
    to the function it wraps, and so to its closure."""
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    @functools.lru_cache
    def weight(k):
        return w

    expected = _backward_grads(lambda: torch.tanh(X @ weight(0)), [w])
    assert_close(_backward_grads(lambda: remat(lambda x: torch.tanh(x @ weight(0)))(X), [w]), expected)


def test_a_tensor_in_a_simple_namespace_is_routed():
    """Namespaces of the standard library are attribute bags: walked like any object."""
    box = types.SimpleNamespace(w=torch.randn(4, 4, dtype=D, requires_grad=True))
    expected = _backward_grads(lambda: torch.tanh(X @ box.w), [box.w])
    assert_close(_backward_grads(lambda: remat(lambda x: torch.tanh(x @ box.w))(X), [box.w]), expected)


class _LowRank(torch.nn.Module):
    """A LoRA written as a parametrization: weight = W + B @ A (minLoRA's pattern)."""

    def __init__(self, n, r=2):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(r, n, dtype=D))
        self.B = torch.nn.Parameter(torch.randn(n, r, dtype=D))

    def forward(self, w):
        return w + self.B @ self.A


def _parametrized_linear():
    import torch.nn.utils.parametrize as parametrize

    lin = torch.nn.Linear(4, 4, dtype=D)
    parametrize.register_parametrization(lin, "weight", _LowRank(4))
    lin.parametrizations.weight.original.requires_grad_(False)  # frozen base weight
    return lin


def _parametrized_pair():
    """Two parametrized layers and remat'd copies with the same weights (rebuilt and loaded:
    a deepcopy of a parametrized module changes what ``cached()`` gives in torch itself)."""
    layers = [_parametrized_linear(), _parametrized_linear()]
    wrapped = []
    for m in layers:
        w = _parametrized_linear()
        w.load_state_dict(m.state_dict())
        wrapped.append(remat(w))
    return layers, wrapped


@pytest.mark.parametrize("read_before", [False, True])
def test_parametrize_cached_weight_is_recomputed_inside_the_call(read_before):
    """Under ``parametrize.cached()`` a parametrized weight computed in the call went into
    torch's global cache and outlived the call: refused as an escaped tensor, a false
    CheckpointError (and one cached before the call was refused as a tensor remat cannot
    route). The run now keeps its own cache, and the caller's is left as it was."""
    import torch.nn.utils.parametrize as parametrize

    layers, wrapped = _parametrized_pair()

    def loss(mods):
        with parametrize.cached():
            before = mods[0].weight if read_before else None  # cached by the caller, before the call
            out = mods[1](torch.tanh(mods[0](X))).square().sum()
            if read_before:
                assert mods[0].weight is before  # the caller's entry is still there
                out = out + before.square().sum()
        return out

    def trainable(mods):
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    assert len(trainable(layers)) == 6  # A, B and the bias of each
    assert_close(torch.autograd.grad(loss(wrapped), trainable(wrapped)), torch.autograd.grad(loss(layers), trainable(layers)))


def test_parametrize_cached_weight_under_torch_func_grad():
    import torch.nn.utils.parametrize as parametrize

    layers, wrapped = _parametrized_pair()

    def loss(mods):
        def f(params):
            with parametrize.cached():
                h = tf.functional_call(mods[0], params[0], (X,), strict=False)
                return tf.functional_call(mods[1], params[1], (torch.tanh(h),), strict=False).square().sum()

        return f

    params = [{n: p.detach() for n, p in m.named_parameters() if p.requires_grad} for m in layers]
    assert_close(tf.grad(loss(wrapped))(params), tf.grad(loss(layers))(params))


def test_closure_tensor_returned_untouched_gets_its_gradient():
    """A remat'd function that returns a closed-over tensor as it is (JAX's test_remat_jit2:
    ``remat(lambda: y)()``) raised a false CheckpointError: no operator received ``y``, so it
    was never substituted and left the region as the caller's tensor."""
    import torch.func as tf

    from funckpt import remat

    x = torch.tensor(3.0, dtype=torch.float64)

    def f(x):
        y = 2 * x
        a = remat(lambda: y)()
        b = remat(lambda z: (y, z * y))(x)
        return a * b[0] + b[1]

    def ref(x):
        y = 2 * x
        return y * y + x * y

    assert_close(tf.grad(f)(x), tf.grad(ref)(x))
    assert_close(tf.grad(tf.grad(f))(x), tf.grad(tf.grad(ref))(x))
    assert_close(tf.jvp(f, (x,), (torch.ones_like(x),)), tf.jvp(ref, (x,), (torch.ones_like(x),)))
    xs = torch.linspace(1, 2, 3, dtype=torch.float64)
    assert_close(tf.vmap(tf.grad(f))(xs), tf.vmap(tf.grad(ref))(xs))
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(xx), xx)
    assert_close(g, tf.grad(ref)(x))


# A module's own tensor reached other than through its attribute (a hook's closure, a
# list or partial the module keeps privately): only the substitution mode routes it,
# the reparametrization of the module's places does not reach it.


def _hooked_linear():
    lin = torch.nn.Linear(4, 4, dtype=D)
    w = lin.weight
    lin.register_forward_hook(lambda m, i, o: torch.tanh(o) @ w)
    return lin


def test_forward_hook_closing_over_the_modules_own_parameter():
    lin = _hooked_linear()
    params = list(lin.parameters())
    expected = _backward_grads(lambda: lin(X), params)
    assert_close(_backward_grads(lambda: remat(lin)(X), params), expected)


def _adapted_block(how, store):
    """A two-layer block whose first layer gets ``store[0]`` (a steering vector, outside the model)
    added to its output by code the layer runs at its call: a forward hook, a pre-hook on the
    second layer, or a ``forward`` set on the instance (a hand-written adapter)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh(), torch.nn.Linear(4, 4, dtype=D))
    if how == "forward hook":
        block[0].register_forward_hook(lambda m, args, out: out + store[0])
    elif how == "pre-hook":
        block[2].register_forward_pre_hook(lambda m, args: (args[0] * store[0],))
    else:
        plain = block[0].forward
        block[0].forward = types.MethodType(lambda self, x: plain(x) + torch.sin(x) * store[0], block[0])
    return block


@pytest.mark.parametrize("how", ["forward hook", "pre-hook", "instance forward"])
def test_code_a_submodule_runs_at_its_call_reaching_a_tensor_outside_the_model(how):
    """Hooks and an instance's ``forward`` run inside the remat'd call, as the function's closure does:
    the trainable tensors they reach get their gradients (under ``.backward()``, ``torch.func.grad``
    of a function that puts its input where the hook reads it, and ``vmap`` of that), where they
    used to be refused as unreachable."""
    vector = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    results = []
    for wrap in (lambda m: m, remat):
        store = [vector.clone().requires_grad_()]
        block = _adapted_block(how, store)
        model = wrap(block)
        leaves = [store[0], *block.parameters()]
        model(X).square().sum().backward()
        by_autograd = [t.grad for t in leaves]

        def loss(v, x):
            store[0] = v
            return model(x).square().sum()

        by_grad = tf.grad(loss)(vector, X)
        per_example = tf.vmap(tf.grad(loss), in_dims=(None, 0))(vector, X)
        results.append((by_autograd, by_grad, per_example))
    assert all(g is not None for g in results[0][0])
    assert_close(results[1], results[0])


def test_a_forward_set_on_the_remat_d_module_itself_reaching_a_tensor_outside_it():
    """``remat(m)`` and ``checkpoint(m, x)`` of a module whose instance ``forward`` was replaced by a
    closure over a trainable tensor (a hand-written adapter on the module itself): the gradients
    are those without remat."""
    results = []
    for wrap in (lambda m: m, remat, lambda m: functools.partial(checkpoint, m, use_reentrant=False)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4, dtype=D)
        scale = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        plain = lin.forward
        lin.forward = lambda x: plain(x).tanh() * scale  # type: ignore[method-assign]
        wrap(lin)(X).square().sum().backward()
        results.append((scale.grad, lin.weight.grad, lin.bias.grad))
    assert_close(results[1], results[0])
    assert_close(results[2], results[0])


@pytest.mark.parametrize("held", ["intervention module", "layer of another segment"])
def test_a_hook_applying_a_module_the_remat_d_call_does_not_hold(held):
    """A hook closing over a module with trainable parameters that the checkpointed region does not
    hold: an intervention kept outside the model (pyreft's way), or a layer that ``remat(Sequential)``
    puts in another segment. Its parameters get their gradients, under ``.backward()``,
    ``torch.func.grad`` and ``vmap`` of it (a false CheckpointError before)."""

    def make():
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh(), torch.nn.Linear(4, 4, dtype=D))
        other = torch.nn.Linear(4, 4, dtype=D) if held == "intervention module" else block[2]
        block[0].register_forward_hook(lambda m, args, out: out + torch.sin(other(out)))
        return block, other

    results = []
    for wrap in (lambda m: m, remat):
        block, other = make()
        model = wrap(block)
        model(X).square().sum().backward()
        both = torch.nn.ModuleDict({"model": model, "other": other})  # (functional_call swaps other's too)
        params = {k: v.detach() for k, v in both.named_parameters()}

        def loss(p, x):
            return tf.functional_call(both, p, (x,)).square().sum()

        both.forward = lambda x: model(x)  # type: ignore[method-assign]
        by_grad = tf.grad(loss)(params, X)
        per_example = tf.vmap(tf.grad(loss), in_dims=(None, 0))(params, X)
        results.append(([p.grad for p in (*block.parameters(), *other.parameters())], by_grad, per_example))
    assert_close(results[1], results[0])


def test_a_global_module_hook_reaching_a_tensor_outside_the_model():
    """A hook registered for every module (``register_module_forward_hook``) runs inside the remat'd
    call at each module it calls: the tensor it reaches gets its gradient, as through a module's own
    hook, under ``.backward()`` and ``torch.func.grad``."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh(), torch.nn.Linear(4, 4, dtype=D))
    vector = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    store = [vector]

    def steer(module, args, out):
        return out + store[0] if isinstance(module, torch.nn.Tanh) else None

    handle = torch.nn.modules.module.register_module_forward_hook(steer)
    try:
        results = []
        for model in (block, remat(block), lambda x: checkpoint(block, x, use_reentrant=False)):
            store[0] = leaf = vector.clone().requires_grad_()
            model(X).square().sum().backward()

            def loss(v):
                store[0] = v
                return model(X).square().sum()

            results.append((leaf.grad, tf.grad(loss)(vector)))
        assert results[0][0] is not None
        assert_close(results[1], results[0])
        assert_close(results[2], results[0])
    finally:
        handle.remove()


def test_module_reading_its_parameter_from_an_unregistered_list():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=D))
            self._ws = [self.w]  # a plain list: not registered, not walked

        def forward(self, x):
            return torch.tanh(x @ self._ws[0])

    net = Net()
    params = list(net.parameters())
    expected = _backward_grads(lambda: net(X), params)
    assert_close(_backward_grads(lambda: remat(net)(X), params), expected)


def test_scan_step_module_with_a_hook_closing_over_its_parameter():
    from funckpt import scan

    lin = _hooked_linear()
    xs = torch.randn(3, 3, 4, dtype=D, generator=torch.Generator().manual_seed(5))

    def step(c, x):
        c = torch.tanh(lin(c) + x)
        return c, None

    def python_loop():
        c = X
        for x in xs:
            c, _ = step(c, x)
        return c

    params = list(lin.parameters())
    expected = _backward_grads(python_loop, params)
    assert_close(_backward_grads(lambda: scan(step, X, xs)[0], params), expected)


class _ListNet(torch.nn.Module):
    """Reads its parameter from a plain list it keeps (not registered, not walked)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(6)))
        self._ws = [self.w]

    def forward(self, x):
        return torch.tanh(x @ self._ws[0]) + x @ self.w


class _ReturnsItsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(7)))

    def forward(self, x):
        return torch.tanh(x @ self.w), self.w


def _nested_hidden():
    """An outer module whose function calls a remat'd closure over the outer's own weight."""
    lin = torch.nn.Linear(4, 4, dtype=D)
    w = lin.weight
    inner = remat(lambda h: torch.sin(h @ w))
    lin.register_forward_hook(lambda m, i, o: inner(o))
    return lin


_HIDDEN = {
    "hook closure": lambda: _hooked_linear(),
    "private list": lambda: _ListNet(),
    "returns its weight": lambda: _ReturnsItsWeight(),
    "nested remat over a closure": lambda: _nested_hidden(),
    "places only": lambda: _mlp(),
}


def _loss_of(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * o).sum() for o in outs)


@pytest.mark.parametrize("route", [".backward()", "double backward", "grad", "vmap(grad)", "jvp(grad)"])
@pytest.mark.parametrize("case", sorted(_HIDDEN))
def test_modules_own_tensors_reached_other_ways_get_their_gradient(case, route):
    """Whichever way a module reaches its own tensors, and under every route, the recomputation
    gives them the gradient the plain module does (it keeps the substitution mode where the
    forward run saw a tensor reached other than through its module place). Under torch.func
    the gradient is the input's: functional_call would replace the attribute, not the tensor
    a closure or list holds, with or without remat."""
    net = _HIDDEN[case]()
    params = list(net.parameters())

    def of_x(m):
        return lambda x: _loss_of(m(x))

    if route == ".backward()":
        got = _backward_grads(lambda: _loss_of(remat(net)(X)).reshape(1), params)
        expected = _backward_grads(lambda: _loss_of(net(X)).reshape(1), params)
    elif route == "double backward":
        def gnorm(m):
            x = X.clone().requires_grad_()
            (g,) = torch.autograd.grad(_loss_of(m(x)), x, create_graph=True)
            return torch.autograd.grad(g.square().sum(), params)

        got, expected = gnorm(remat(net)), gnorm(net)
    elif route == "grad":
        got, expected = tf.grad(of_x(remat(net)))(X), tf.grad(of_x(net))(X)
    elif route == "vmap(grad)":
        got, expected = tf.vmap(tf.grad(of_x(remat(net))))(X), tf.vmap(tf.grad(of_x(net)))(X)
    else:
        t = torch.ones_like(X)
        got = tf.jvp(tf.grad(of_x(remat(net))), (X,), (t,))
        expected = tf.jvp(tf.grad(of_x(net)), (X,), (t,))
    assert_close(got, expected)


def test_functional_call_of_a_module_reaching_its_places_only_under_every_transform():
    net = _mlp()
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, x, m):
        return _loss_of(tf.functional_call(m, p, (x,)))

    assert_close(tf.grad(loss)(params, X, remat(net)), tf.grad(loss)(params, X, net))
    xs = X.unsqueeze(1)
    per_example = tf.vmap(tf.grad(loss), in_dims=(None, 0, None))
    assert_close(per_example(params, xs, remat(net)), per_example(params, xs, net))
    hess = tf.jacrev(tf.grad(loss, argnums=1), argnums=1)
    assert_close(hess(params, X, remat(net)), hess(params, X, net))


def _substitution_calls_in_backward(net, monkeypatch):
    from funckpt import _capture

    calls = []
    handler = _capture.Substitute.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(self.forward)
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(_capture.Substitute, "__torch_function__", counting)
    x = X.clone().requires_grad_()
    out = remat(net)(x)
    forward_calls = len(calls)
    _loss_of(out).backward()
    return forward_calls, calls[forward_calls:]


def test_module_reached_through_its_places_recomputes_without_the_substitution_mode(monkeypatch):
    """The mode costs a Python call per operator; the recomputation of a module that reaches its
    tensors only through its attributes needs none (reparametrization fills those places)."""
    forward_calls, backward_calls = _substitution_calls_in_backward(_mlp(), monkeypatch)
    assert forward_calls > 0  # the forward run checks every operator
    assert backward_calls == []


class _ClosesOverItsWeight(torch.nn.Module):
    """Reaches its linear's weight through a function it keeps, which closes over it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        w = self.lin.weight
        self.post = lambda o: torch.tanh(o) @ w

    def forward(self, x):
        return self.post(self.lin(x))


def test_module_reaching_its_weight_through_a_closure_recomputes_under_the_substitution_mode(monkeypatch):
    _, backward_calls = _substitution_calls_in_backward(_ClosesOverItsWeight(), monkeypatch)
    assert backward_calls and not any(backward_calls)  # the recomputation's own mode


def test_a_forward_hook_of_a_remat_layer_runs_outside_the_checkpointed_call(monkeypatch):
    # (its closure's weight is the module's own: the hook runs once, around the call)
    _, backward_calls = _substitution_calls_in_backward(_hooked_linear(), monkeypatch)
    assert backward_calls == []


class _CachesItsWeightOnFirstCall(torch.nn.Module):
    """Keeps a private list of its weight, filled on its first call: inside remat, that is
    remat's forward-run substitute, which the recomputation would then read."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(9)))
        self._ws = None

    def forward(self, x):
        if self._ws is None:
            self._ws = [self.w]
        return torch.tanh(x @ self._ws[0])


@pytest.mark.parametrize("route", [".backward()", "double backward", "grad of x", "functional_call grad"])
def test_module_storing_the_forward_runs_substitute_is_refused_not_silently_wrong(route):
    # (refused at the forward run that stores it, since its class stores attributes: see
    # test_a_module_storing_an_input_on_itself_raises; the recomputation refused it before)
    net = _CachesItsWeightOnFirstCall()
    with pytest.raises(CheckpointError, match="stored one of its inputs .* a module attribute"):
        if route == ".backward()":
            remat(net)(X).square().sum().backward()
        elif route == "double backward":
            x = X.clone().requires_grad_()
            (g,) = torch.autograd.grad(remat(net)(x).square().sum(), x, create_graph=True)
            torch.autograd.grad(g.sum(), net.w)
        elif route == "grad of x":
            tf.grad(lambda x: remat(net)(x).square().sum())(X)
        else:
            params = {k: v.detach() for k, v in net.named_parameters()}
            tf.grad(lambda p: tf.functional_call(remat(net), p, (X,)).square().sum())(params)


class _AlternatesItsPath(torch.nn.Module):
    """Reads its weight through its attribute on odd calls, through a list on even ones."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(10)))
        self.tied = [self.w]
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x @ (self.w if self.calls % 2 else self.tied[0]))


class _MakesAParameterOnItsFirstCall(torch.nn.Module):
    def forward(self, x):
        if not hasattr(self, "scale"):
            self.scale = torch.nn.Parameter(torch.ones(4, dtype=D) * 2)
        return torch.tanh(x) * self.scale


def test_recomputation_reaching_a_weight_another_way_than_the_forward_run_gets_its_gradient():
    """State that changes between the runs may change the way a module reaches its tensors; the
    recomputation sees that its graph left its inputs and runs again under the substitution mode."""
    net = _AlternatesItsPath()
    expected = torch.autograd.grad(torch.tanh(X @ net.w).square().sum(), net.w)
    assert_close(torch.autograd.grad(remat(net)(X).square().sum(), net.w), expected)


def test_module_rebound_between_forward_and_backward_is_refused_not_silently_dropped():
    import copy

    holder = types.SimpleNamespace(layer=torch.nn.Linear(4, 4, dtype=D))
    y = remat(lambda x: torch.tanh(holder.layer(x)))(X)
    holder.layer = copy.deepcopy(holder.layer)  # same values, other parameters
    with pytest.raises(CheckpointError, match="neither an argument nor reachable"):
        y.square().sum().backward()


class _PlainWeight(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w  # a plain tensor attribute, not a Parameter

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("kind", ["same shape, plain tensor", "another shape"])
def test_module_with_a_plain_weight_rebound_between_forward_and_backward_is_refused(kind):
    base = torch.randn(4, 4, dtype=D, requires_grad=True)
    holder = types.SimpleNamespace(layer=_PlainWeight(base))
    y = remat(lambda x: torch.tanh(holder.layer(x)))(X)
    shape = (4, 4) if kind == "same shape, plain tensor" else (5, 4)
    holder.layer = _PlainWeight(torch.randn(*shape, dtype=D, requires_grad=True))
    with pytest.raises(CheckpointError, match="neither an argument nor reachable"):
        y.square().sum().backward()


def test_recomputation_run_again_under_the_mode_with_torchs_selective_checkpointing():
    """A recomputation that runs again (its first run reached a weight another way) with torch's
    selective-checkpoint contexts as context_fn: their recomputation context serves one run."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    net = _AlternatesItsPath()
    expected = torch.autograd.grad(torch.tanh(X @ net.w).square().sum(), net.w)
    f = remat(net, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    assert_close(torch.autograd.grad(f(X).square().sum(), net.w), expected)


def test_function_making_a_leaf_of_its_own_recomputes_once():
    """A leaf made inside the function and set to require grad (HF T5's position bias under
    checkpointing) is the run's own: no false alarm, the right gradient, one recomputation."""
    from funckpt import _call

    lin = torch.nn.Linear(4, 4, dtype=D)

    def f(x):
        bias = torch.zeros(4, dtype=D)
        bias.requires_grad = True
        return torch.tanh(lin(x) + bias)

    runs = []
    recompute = _call.UserRegion.recompute

    def counted(self, given):
        runs.append(1)
        return recompute(self, given)

    params = list(lin.parameters())
    expected = torch.autograd.grad(f(X).square().sum(), params)
    _call.UserRegion.recompute = counted
    try:
        got = torch.autograd.grad(remat(f)(X).square().sum(), params)
    finally:
        _call.UserRegion.recompute = recompute
    assert_close(got, expected)
    assert len(runs) == 1


def test_parameter_made_on_the_first_call_inside_remat_is_refused_not_silently_dropped():
    x = X.clone().requires_grad_()
    with pytest.raises(CheckpointError, match="neither an argument nor reachable"):
        remat(_MakesAParameterOnItsFirstCall())(x).square().sum().backward()


class _RebuildsItsBlockOnItsFirstCall(torch.nn.Module):
    """HF BigBird's switch of attention type on a short sequence: on its first call the module builds
    a new block (whose fresh Linear nn.init writes) and moves its trained Linear into it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.block = torch.nn.Identity()
        self.switched = False

    def forward(self, x):
        if not self.switched:
            self.switched = True
            fresh = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh())
            fresh[0] = self.lin
            self.block = fresh
        return self.block(x).square()


@pytest.mark.parametrize("how", [".backward()", "torch.func.grad"])
def test_a_module_built_inside_the_call_and_initialized_there_is_no_foreign_tensor(how):
    """nn.init writes the new module's parameters under no_grad: no gradient flows from them, and the
    gradient of the Linear moved into the new block is the one without remat."""

    def grads(wrap):
        torch.manual_seed(0)
        net = _RebuildsItsBlockOnItsFirstCall()
        f = wrap(net)
        if how == ".backward()":
            f(X).sum().backward()
            return {n: p.grad for n, p in net.named_parameters()}
        return tf.grad(lambda p: tf.functional_call(f, p, (X,)).sum())({n: p.detach() for n, p in net.named_parameters()})

    assert_close(grads(remat), grads(lambda m: m))


def _builds_its_layers(x):
    """A function that builds torch.nn layers and uses them (their parameters, made from
    ``torch.empty`` and initialized with ``nn.init``, are its own leaves)."""
    lin = torch.nn.Linear(4, 4, dtype=D)
    norm = torch.nn.LayerNorm(4, dtype=D)
    return torch.tanh(norm(lin(x)))


@pytest.mark.parametrize("how", ["backward", "grad", "jvp"])
def test_layers_built_and_used_inside_the_function_are_its_own(how):
    """Their parameters' gradients stay inside the function, as without remat and under
    torch.utils.checkpoint; remat gives the function's own gradient (and tangent), the layers drawn
    again from the same random state in the recomputation."""

    def run(f):
        torch.manual_seed(3)
        if how == "backward":
            x = X.clone().requires_grad_()
            return torch.autograd.grad(f(x).sum(), x)
        if how == "grad":
            return tf.grad(lambda x: f(x).sum())(X)
        return tf.jvp(f, (X,), (torch.ones_like(X),))

    assert_close(run(remat(_builds_its_layers)), run(_builds_its_layers))


def test_a_parameter_made_inside_on_memory_the_run_did_not_allocate_is_still_refused():
    """``nn.Parameter(torch.ones(...))``: no mode sees the Parameter made, and its memory came from an
    operator whose results the run does not follow (README: limits)."""
    x = X.clone().requires_grad_()
    with pytest.raises(CheckpointError, match="neither an argument nor reachable"):
        remat(lambda x: x @ torch.nn.Parameter(torch.ones(4, 4, dtype=D)))(x)


class _DoRAOnAConv1D(torch.nn.Module):
    """peft's DoRA on GPT-2's Conv1D: ``transpose(weight, fan_in_fan_out)`` makes a new Parameter of
    the transposed weight at every call, then a norm of it that the layer detaches."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 6, dtype=D))
        self.lora = torch.nn.Parameter(torch.randn(6, 4, dtype=D) / 10)
        self.magnitude = torch.nn.Parameter(torch.ones(6, dtype=D))

    def forward(self, x):
        w = torch.nn.Parameter(self.weight.T) + self.lora
        norm = torch.linalg.norm(w, dim=1).detach()
        return (x @ w.T) * (self.magnitude / norm)


@pytest.mark.parametrize("how", [".backward()", "torch.func.grad"])
def test_a_parameter_the_function_makes_on_an_inputs_memory_is_its_own(how):
    """Made by nn.Parameter, where no mode sees it made, on the memory of an input: a gradient into it
    reaches no input, with remat or without."""

    def grads(wrap):
        torch.manual_seed(0)
        layer = _DoRAOnAConv1D()
        f = wrap(layer)
        if how == ".backward()":
            f(X).square().sum().backward()
            return {n: p.grad for n, p in layer.named_parameters()}
        params = {n: p.detach() for n, p in layer.named_parameters()}
        return tf.grad(lambda p: tf.functional_call(f, p, (X,)).square().sum())(params)

    assert_close(grads(remat), grads(lambda m: m))


class _FcOut(torch.nn.Module):
    """Two layers whose ``fc`` the tests below replace or wrap between forward and backward."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4, dtype=D)
        self.out = torch.nn.Linear(4, 4, dtype=D)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("forwarding_property", [False, True])
def test_submodule_wrapped_between_forward_and_backward_keeps_its_gradient(forwarding_property):
    """A layer wrapped in place after the call (as adapter and hook tools do): the same
    parameters sit one level deeper; the recomputation still routes them. The wrapper may
    forward ``weight`` to the layer through a read-only property (as PEFT's LoRA layers do)."""

    class Wrapper(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    class ForwardingWrapper(Wrapper):
        @property
        def weight(self):
            return self.base_layer.weight

    net = _FcOut()
    params = list(net.parameters())
    expected = torch.autograd.grad(net(X).square().sum(), params)
    out = remat(net)(X)
    net.fc = (ForwardingWrapper if forwarding_property else Wrapper)(net.fc)
    assert_close(torch.autograd.grad(out.square().sum(), params), expected)


def test_frozen_eval_transformer_encoder_with_a_padding_mask_raises_no_false_alarm():
    """torch's fast path of an eval-mode TransformerEncoder is off under any torch-function mode,
    and gives other values at padded positions. The forward run (under the substitution mode)
    takes the regular path; so does the recomputation: no false alarm, and remat's gradient
    is the regular path's (the plain module's, under any torch-function mode)."""
    from torch.overrides import TorchFunctionMode

    class Regular(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
            self.enc.requires_grad_(False).eval()
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x, pad):
            return self.head(self.enc(x, src_key_padding_mask=pad))

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with Regular():
        expected = torch.autograd.grad(model(x, pad).sum(), list(model.head.parameters()))
    got = torch.autograd.grad(remat(model)(x, pad).sum(), list(model.head.parameters()))
    assert_close(got, expected)


def test_an_eval_transformer_encoder_layer_under_hessian_of_its_input():
    """Under torch.func.hessian with respect to the layer's input, a recomputation has nothing to
    substitute (the parameters are the module's own): it still runs under the substitution mode,
    so the eval-mode layer takes its regular path as in the forward run, not the fused fast-path
    kernel, which forward-mode AD cannot go through (and whose operators a policy's kept values
    would not match)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=D).eval()
    x = torch.randn(2, 3, 8, dtype=D)
    b = torch.randn(8, dtype=D)

    def loss(model):
        return lambda b: model(x + b).tanh().sum()

    with sdpa_kernel(SDPBackend.MATH):  # (twice differentiable without remat too)
        expected = tf.hessian(loss(layer))(b)
        for policy in (None, policies.dots_saveable):
            assert_close(tf.hessian(loss(remat(layer, policy=policy)))(b), expected)


def test_submodule_replaced_between_forward_and_backward():
    """The recomputation uses the tensors of the call under the names of the call, as
    functional_call would: the parameters the forward pass used get the gradient."""
    import copy

    net = _FcOut()
    params = list(net.parameters())
    expected = torch.autograd.grad(net(X).square().sum(), params)
    out = remat(net)(X)
    net.fc = copy.deepcopy(net.fc)  # same values, new tensors
    assert_close(torch.autograd.grad(out.square().sum(), params), expected)


class _RebindsItsBuffers(torch.nn.Module):
    """Rebinds registered buffers in its forward instead of writing them in place: a step
    counter, an EMA of its activations, and an index table built lazily for the input's size
    over a placeholder buffer (timm's ConViT ``rel_indices``); the output reads all three."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.register_buffer("count", torch.zeros((), dtype=D))
        self.register_buffer("ema", torch.zeros(4, dtype=D))
        self.register_buffer("table", torch.zeros(1, dtype=D))

    def forward(self, x):
        if self.table.shape[0] != x.shape[0]:
            self.table = torch.arange(x.shape[0], dtype=D)
        y = self.lin(x)
        self.count = self.count + 1
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        return torch.tanh(y) * self.count + self.table[:, None] + self.ema


@pytest.mark.parametrize("route", ["remat", "checkpoint", "remat(Sequential)"])
def test_buffers_rebound_in_the_forward_are_kept_once_not_dropped(route):
    """The forward run's new buffers stay in the module, as without remat; the recomputation's
    are dropped (the state steps once per forward pass); the gradients are the plain module's."""
    import copy

    from funckpt import checkpoint

    torch.manual_seed(0)
    reference = torch.nn.Sequential(_RebindsItsBuffers(), _RebindsItsBuffers())
    net = copy.deepcopy(reference)
    if route == "remat":
        model = torch.nn.Sequential(*[remat(layer) for layer in net])
    elif route == "checkpoint":
        model = lambda x: checkpoint(net, x, use_reentrant=False)  # noqa: E731
    else:
        model = remat(net)
    for _ in range(2):  # the second step starts from the first one's buffers
        for m in (reference, model):
            m(X).square().sum().backward()
        assert_close(dict(net.named_buffers()), dict(reference.named_buffers()))
        assert_close(dict((k, p.grad) for k, p in net.named_parameters()), dict((k, p.grad) for k, p in reference.named_parameters()))
    assert net[0].count.item() == 2


def test_buffers_rebound_under_torch_func_grad_of_functional_call():
    import copy

    torch.manual_seed(0)
    reference = _RebindsItsBuffers()
    net = copy.deepcopy(reference)

    def grads(model):
        params = {k: v.detach() for k, v in model.named_parameters()}
        return tf.grad(lambda p: tf.functional_call(model, p, (X,)).square().sum())(params)

    assert_close(grads(remat(net)), grads(reference))
    assert_close(dict(net.named_buffers()), dict(reference.named_buffers()))



def test_old_style_spectral_norm_whose_pre_hook_rebinds_the_weight_with_a_graph():
    """The pre-hook of ``nn.utils.spectral_norm`` sets ``module.weight`` to a tensor computed from
    ``weight_orig`` at every call: a rebinding with a graph, which the forward run does not
    keep (it would outlive the call's local graph). Two steps equal the plain module's."""
    import copy

    torch.manual_seed(0)
    reference = torch.nn.utils.spectral_norm(torch.nn.Linear(4, 4, dtype=D))
    net = copy.deepcopy(reference)
    for _ in range(2):
        for m in (reference, remat(net)):
            m(X).square().sum().backward()
        assert_close(dict(net.named_buffers()), dict(reference.named_buffers()))
        assert_close(net.weight_orig.grad, reference.weight_orig.grad)


class _AveragesWithItsGraph(torch.nn.Module):
    """Rebinds a buffer to an average of its activations that are not detached: the buffer then
    carries the call's graph, and the next call's output (and gradient) goes through it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.register_buffer("ema", torch.zeros(4, dtype=D))

    def forward(self, x):
        y = self.lin(x)
        out = torch.tanh(y) * self.ema.sum() + y
        self.ema = 0.9 * self.ema + 0.1 * y.mean(0)
        return out


def test_a_buffer_rebound_to_a_tensor_with_a_graph_keeps_it_under_plain_autograd():
    """Without remat the second call reads the first one's average and differentiates through
    it. Under plain autograd the average escapes the first call and becomes one of its outputs:
    the second call gets it as a buffer, and the gradient flows back through both calls."""
    import copy

    torch.manual_seed(0)
    reference = _AveragesWithItsGraph()
    net = copy.deepcopy(reference)

    def run(model):
        x = X.clone().requires_grad_()
        (model(x) + model(x)).square().sum().backward()
        return x.grad, {k: p.grad for k, p in model.named_parameters()}

    assert_close(run(remat(net)), run(reference))
    assert_close(net.ema, reference.ema)


@pytest.mark.parametrize("route", ["grad", "grad_of_functional_call"])
def test_a_buffer_rebound_to_a_tensor_with_a_graph_raises_under_torch_func(route):
    """There remat can give the average no graph at the transform's level, and dropping it
    silently gave other values."""
    import copy

    from funckpt import CheckpointError

    torch.manual_seed(0)
    reference = _AveragesWithItsGraph()
    net = copy.deepcopy(reference)

    def run(model):
        twice = lambda x: (model(x) + model(x)).square().sum()  # noqa: E731
        if route == "grad":
            return tf.grad(twice)(X)
        params = {k: v.detach() for k, v in model.named_parameters()}
        return tf.grad(lambda p: (tf.functional_call(model, p, (X,)) * 2).square().sum())(params)

    run(reference)  # a valid program without remat
    with pytest.raises(CheckpointError, match="rebound _AveragesWithItsGraph.ema"):
        run(remat(net))
    assert_close(net.ema, torch.zeros(4, dtype=D))  # left as it was


def test_old_style_weight_norm_whose_pre_hook_rebinds_the_weight_with_a_graph():
    """As spectral_norm's: weight_norm's pre-hook computes ``weight`` at every call (not deep-copyable)."""
    import copy

    plain = torch.nn.Linear(4, 4, dtype=D)
    reference = torch.nn.utils.weight_norm(copy.deepcopy(plain))
    net = torch.nn.utils.weight_norm(plain)
    for _ in range(2):
        for m in (reference, remat(net)):
            m(X).square().sum().backward()
        assert_close(net.weight_g.grad, reference.weight_g.grad)
        assert_close(net.weight_v.grad, reference.weight_v.grad)
        assert_close(net.weight.detach(), reference.weight.detach())  # the call's weight, as without remat
    params = {k: v.detach() for k, v in reference.named_parameters()}

    def grads(m):
        return tf.grad(lambda p: tf.functional_call(m, p, (X,)).square().sum())(params)

    assert_close(grads(remat(net)), grads(reference))


@pytest.mark.parametrize("route", ["backward", "grad_of_functional_call", "vmap_of_grad"])
def test_pruning_whose_pre_hook_rebinds_the_weight_with_a_graph(route):
    """As spectral_norm's: ``nn.utils.prune``'s pre-hook sets ``weight = weight_orig * weight_mask``
    at every call (two methods on one weight, a ``PruningContainer``, too). Under ``torch.func`` the
    rebinding used to be refused as an average with a graph ("the function rebound Linear.weight"),
    on a program that runs without remat."""
    import torch.nn.utils.prune as prune

    def pruned():
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4, dtype=D)
        prune.l1_unstructured(lin, "weight", amount=0.4)
        prune.ln_structured(lin, "weight", amount=0.25, n=1, dim=1)
        prune.random_unstructured(lin, "bias", amount=0.5)
        return lin

    def run(lin, model):
        results = []
        for step in range(2):
            x = X * (step + 1)
            params = {k: v.detach() for k, v in model.named_parameters()}
            if route == "backward":
                model(x).square().sum().backward()
                results.append([p.grad.clone() for p in lin.parameters()])
            elif route == "grad_of_functional_call":
                results.append(tf.grad(lambda p: tf.functional_call(model, p, (x,)).square().sum())(params))
            else:
                one = lambda p, x: tf.functional_call(model, p, (x,)).square().sum()  # noqa: E731
                results.append(tf.vmap(tf.grad(one), in_dims=(None, 0))(params, x))
            results.append(lin.weight.detach())
        return results

    # (Inside the checkpointed function: a remat'd layer's own hooks run around its call.)
    reference, net = pruned(), pruned()
    expected = run(reference, torch.nn.Sequential(reference, torch.nn.Tanh()))
    assert_close(run(net, remat(torch.nn.Sequential(net, torch.nn.Tanh()))), expected)


class _KeepsItsAuxLoss(torch.nn.Module):
    """An MoE layer's pattern: each call stores a loss term it computed on the module."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.aux_loss = None

    def forward(self, x):
        y = self.lin(x)
        self.aux_loss = y.square().mean()
        return y


def test_an_attribute_left_by_a_step_without_remat_is_overwritten_as_without_remat():
    """Checkpointing turned on after a step without it: the attribute holds that step's value,
    whose graph its backward pass freed. Routed as an input, the autograd engine visited that
    graph (even with no gradient for it) and raised torch's "backward through the graph a
    second time"; it is left where it is, as without remat."""
    import copy

    torch.manual_seed(0)
    reference = _KeepsItsAuxLoss()
    net = copy.deepcopy(reference)
    checkpointed = remat(net)
    for step in range(3):
        grads = []
        for module, call in ((reference, reference), (net, checkpointed if step else net)):
            module.zero_grad()
            (call(X).sum() + module.aux_loss).backward()
            grads.append([p.grad for p in module.parameters()])
        assert_close(grads[1], grads[0])


class _KeepsItsLastOutputInABuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.register_buffer("last", torch.zeros(4, dtype=D))

    def forward(self, x):
        y = self.lin(x)
        self.last = y.mean(0)  # (with its graph; overwritten, never read)
        return y


def _a_step_without_then_with_remat(make):
    """A module and its copy take a step without remat; then one steps remat'd, the other not
    (checkpointing turned on after a first step). Their parameters' gradients must agree."""
    import copy

    torch.manual_seed(0)
    reference = make()
    net = copy.deepcopy(reference)
    for module in (reference, net):
        module(X).sum().backward()
    for module, call in ((reference, reference), (net, remat(net))):
        module.zero_grad()
        call(X).sum().backward()
    assert_close([p.grad for p in net.parameters()], [p.grad for p in reference.parameters()])
    return net, reference


def test_a_buffer_left_by_a_step_without_remat_is_overwritten_as_without_remat():
    _a_step_without_then_with_remat(_KeepsItsLastOutputInABuffer)


@pytest.mark.parametrize("hooks", [None, "save_on_cpu"])
def test_a_container_entry_left_by_a_call_without_remat_is_overwritten_as_without_remat(hooks):
    """The function keeps an intermediate in a dict it closes over (keep["h"] = h); called once
    without remat and differentiated, then remat'd. (A graph saved through saved-tensor hooks is
    told freed without running them.)"""
    keep = {}
    w = GLOBAL_W.detach().clone().requires_grad_()

    def f(x):
        h = x @ w
        keep["h"] = h
        return h.sin().sum()

    def first_call():
        if hooks is None:
            f(X).backward()
        else:
            with torch.autograd.graph.save_on_cpu():
                f(X).backward()

    first_call()
    w.grad = None
    f(X).backward()
    expected = w.grad.clone()
    first_call()
    w.grad = None
    remat(f)(X).backward()
    assert_close(w.grad, expected)
    assert keep["h"].grad_fn is not None  # (the forward run's, kept as without remat)


def _freed_value():
    """A value whose graph a backward pass freed, as a differentiated call without remat leaves it."""
    w = GLOBAL_W.detach().clone().requires_grad_()
    value = (X @ w).sin()
    value.sum().backward()
    return value


def test_a_gradient_reaching_a_value_whose_graph_a_backward_freed_raises_a_checkpoint_error():
    """Without remat the backward through it raises torch's RuntimeError; remat's stand-in says so."""
    keep = {"h": _freed_value()}
    v = GLOBAL_W.detach().clone().requires_grad_()

    def f(x):
        return (x @ v * keep["h"]).sum()

    with pytest.raises(RuntimeError, match="second time"):
        f(X).backward()  # (the un-remat'd program fails too)
    with pytest.raises(CheckpointError, match="reached a tensor .* whose graph a backward pass has freed"):
        remat(f)(X).backward()


@pytest.mark.parametrize(
    "route", ["forward_only", "grad_of_another_input", "backward_inputs", "jvp", "vmap", "item", "no_grad_scale"]
)
def test_a_value_whose_graph_a_backward_freed_is_used_as_without_remat_where_no_gradient_reaches_it(route):
    """Read as a constant, or where no backward goes through it: as without remat (no false alarm)."""
    keep = {"h": _freed_value()}
    v = GLOBAL_W.detach().clone().requires_grad_()

    def f(x):
        if route == "item":
            return (x @ v).sum() * keep["h"].abs().max().item()
        if route == "no_grad_scale":
            with torch.no_grad():
                scale = keep["h"].square().mean()
            return (x @ v).sum() * scale
        return (x @ v * keep["h"]).sum()

    def run(call):
        if route == "forward_only":
            return call(X)
        if route == "grad_of_another_input":
            return torch.autograd.grad(call(X), v)
        if route == "backward_inputs":
            v.grad = None
            call(X).backward(inputs=[v])
            return v.grad
        if route == "jvp":
            return tf.jvp(call, (X,), (torch.ones_like(X),))
        if route == "vmap":
            return tf.vmap(lambda r: call(r.expand(3, 4)))(X)
        v.grad = None
        call(X).backward()
        return v.grad

    assert_close(run(remat(f)), run(f))


class _LazyRunningMean(torch.nn.Module):
    """Sets a running mean on its first call without detaching it, then updates it under no_grad."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.stat = None

    def forward(self, x):
        y = self.lin(x)
        if self.stat is None:
            self.stat = y.mean(0)
        else:
            with torch.no_grad():
                self.stat.mul_(0.9).add_(0.1 * y.mean(0))
        return y


def test_a_value_whose_graph_a_backward_freed_updated_in_place_under_no_grad_as_without_remat():
    net, reference = _a_step_without_then_with_remat(_LazyRunningMean)
    assert_close(net.stat.detach(), reference.stat.detach())


def test_a_value_left_by_a_reentrant_checkpoint_whose_backward_ran_is_told_freed():
    """Its graph ends in torch's reentrant checkpoint Function, whose saved tensors tell their release."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    w = GLOBAL_W.detach().clone().requires_grad_()
    keep = {"h": torch_checkpoint(lambda x: (x @ w).sin(), X.clone().requires_grad_(), use_reentrant=True)}
    keep["h"].sum().backward()

    def f(x):
        assert "h" in keep  # (reaches it, does not use it)
        return (x @ w).cos().sum()

    def run(call):
        w.grad = None
        call(X).backward()
        return w.grad

    assert_close(run(remat(f)), run(f))


def test_plain_autograd_around_torch_func_grad_with_a_freed_value_reached_as_without_remat():
    """MAML's pattern: torch.func.grad inside, .backward() around it; the call reaches a freed value it does not use."""
    keep = {"h": _freed_value()}
    p = GLOBAL_W.detach().clone().requires_grad_()

    def loss(q):
        assert "h" in keep
        return (X @ q).tanh().sum()

    def run(call):
        p.grad = None
        tf.grad(call)(p).sum().backward()
        return p.grad

    assert_close(run(remat(loss)), run(loss))


@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_under_torch_func_a_value_whose_graph_a_backward_freed_is_read_as_without_remat(transform):
    """A torch.func grad level never differentiates through a plain tensor's graph: reading one whose
    graph is freed is no error there, with or without remat."""
    keep = {}
    w = GLOBAL_W.detach().clone().requires_grad_()

    def produce(x):
        keep["h"] = x @ w
        return keep["h"].sum()

    def consume(v):
        return (X @ v * keep["h"]).sum()

    produce(X).backward()
    v = GLOBAL_W.detach().clone()
    if transform == "grad":
        assert_close(tf.grad(remat(consume))(v), tf.grad(consume)(v))
    else:
        vs = torch.stack([v, 2 * v])
        assert_close(tf.vmap(tf.grad(remat(consume)))(vs), tf.vmap(tf.grad(consume))(vs))


def test_a_value_whose_graph_was_retained_is_still_routed():
    """A graph kept by retain_graph=True is alive: the value is an input, and its gradient flows on."""
    keep = {}
    w = GLOBAL_W.detach().clone().requires_grad_()

    def produce(x):
        keep["h"] = x @ w
        return keep["h"].sum()

    def consume(x):
        return (x @ w * keep["h"]).sum()

    def run(call):
        w.grad = None
        produce(X).backward(retain_graph=True)
        call(X).backward()
        return w.grad

    assert_close(run(remat(consume)), run(consume))


class _DynamicRope(torch.nn.Module):
    """HF's ``dynamic_rope_update``: on an input longer than the cached length, or back to the
    original length, rebind the ``inv_freq`` buffer and record the new length (a tensor, as HF's
    ``torch.max(position_ids) + 1``, or the original int) and a float scaling; read all of them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(1.0, 0.1, 4, dtype=D), persistent=False)
        self.original_inv_freq = self.inv_freq
        self.max_seq_len_cached = self.original_max_seq_len = 4
        self.attention_scaling = 1.0

    def forward(self, x):
        seq_len = torch.tensor(x.shape[0]) if x.shape[0] > 4 else x.shape[0]
        if seq_len > self.max_seq_len_cached:  # growth
            self.register_buffer("inv_freq", self.original_inv_freq / x.shape[0], persistent=False)
            self.max_seq_len_cached, self.attention_scaling = seq_len, 1.0 + 0.1 * x.shape[0]
        if seq_len < self.original_max_seq_len < self.max_seq_len_cached:  # reset
            self.register_buffer("inv_freq", self.original_inv_freq, persistent=False)
            self.max_seq_len_cached, self.attention_scaling = self.original_max_seq_len, 1.0
        positions = torch.arange(x.shape[0], dtype=D)[:, None]
        return x * torch.cos(positions * self.inv_freq) * self.attention_scaling


def _rope_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), _DynamicRope(), torch.nn.Tanh())


@pytest.mark.parametrize("route", ["remat", "checkpoint", "remat(Sequential)"])
def test_a_buffer_rebound_with_a_python_length_is_recomputed_from_both_at_the_call(route):
    """The recomputation starts from the module's state at the call, its plain attributes (the
    cached length, the scaling) as well as its buffer: it makes the same update and computes
    the forward run's values. Growing and shrinking steps, each with its own backward."""
    import copy

    from funckpt import checkpoint

    reference = _rope_net()
    net = copy.deepcopy(reference)
    if route == "remat":
        model = torch.nn.Sequential(net[0], remat(net[1]), net[2])
    elif route == "checkpoint":
        model = lambda x: checkpoint(net, x, use_reentrant=False)  # noqa: E731
    else:
        model = remat(net)
    for n in (6, 6, 8, 3, 7):
        for m in (reference, model):
            m(torch.linspace(-1, 1, 4 * n, dtype=D).view(n, 4)).square().sum().backward()
        assert_close(dict((k, p.grad) for k, p in net.named_parameters()), dict((k, p.grad) for k, p in reference.named_parameters()))
        assert_close(dict(net.named_buffers()), dict(reference.named_buffers()))
        assert (net[1].max_seq_len_cached, net[1].attention_scaling) == (reference[1].max_seq_len_cached, reference[1].attention_scaling)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_buffer_rebound_with_a_python_length_by_two_forwards_before_their_backwards(order):
    """Gradient accumulation over a long and a short sequence: each backward recomputes from its
    own call's state (the second forward reset what the first grew), and the state stays the
    second forward's."""
    import copy

    reference = _rope_net()
    net = copy.deepcopy(reference)
    inputs = [torch.linspace(-1, 1, 4 * n, dtype=D).view(n, 4).requires_grad_() for n in (7, 3)]

    def program(m, module):
        outs = [m(x).square().sum() for x in inputs]
        return [torch.autograd.grad(outs[k], [inputs[k], *module.parameters()]) for k in order]

    expected = program(reference, reference)
    assert_close(program(remat(net), net), expected)
    assert_close(dict(net.named_buffers()), dict(reference.named_buffers()))
    assert net[1].max_seq_len_cached == reference[1].max_seq_len_cached


class _ActNorm(torch.nn.Module):
    """Glow's ActNorm: its first call sets its parameters from the batch in place under
    ``no_grad`` (``buffer=False``), or a buffer (``buffer=True``), and a plain flag so that later
    calls skip that; every call reads them."""

    def __init__(self, buffer):
        super().__init__()
        self.buffer = buffer
        self.scale = torch.nn.Parameter(torch.ones(4, dtype=D))
        if buffer:
            self.register_buffer("loc", torch.zeros(4, dtype=D))
        else:
            self.loc = torch.nn.Parameter(torch.zeros(4, dtype=D))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                if not self.buffer:
                    self.scale.copy_(1 / x.std(0))
            self.initialized = True
        return (x + self.loc) * self.scale


class _NormedLinear(torch.nn.Module):
    def __init__(self, buffer):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(4, 4, dtype=D), _ActNorm(buffer)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x)))


# (torch.func.grad refuses the buffer's write without remat: "would mutate a captured Tensor")
@pytest.mark.parametrize("how, buffer", [("backward", False), ("backward", True), ("grad", False)])
def test_a_write_in_place_guarded_by_a_flag_is_recomputed_from_both_at_the_call(how, buffer):
    """The recomputation starts from the written tensors' values at the call (snapshots) and so
    from the flag's (HF RWKV's weights rescaled once in eval mode, ActNorm's data-dependent
    initialization): with the forward run's flag it would skip the write and compute something
    else, a CheckpointError on a correct program. The flag and the tensors end as without remat."""
    import copy

    torch.manual_seed(0)
    reference = _NormedLinear(buffer)
    net = copy.deepcopy(reference)
    x = torch.randn(8, 4, dtype=D)  # (a frozen input: a call with an input no gradient flows into)

    def step(model, module):
        if how == "backward":
            module.zero_grad()
            model(x).square().sum().backward()
            return {k: p.grad for k, p in module.named_parameters()}
        params = {k: p.detach() for k, p in module.named_parameters()}
        return tf.grad(lambda p: tf.functional_call(model, p, (x,)).square().sum())(params)

    for _ in range(2):  # (the first call initializes, the second reads)
        assert_close(step(remat(net), net), step(reference, reference))
        assert_close(net.state_dict(), reference.state_dict())
        assert net.norm.initialized and reference.norm.initialized


class _CachesATableForItsLength(torch.nn.Module):
    """Caches a tensor built for the input's length (a plain tensor attribute) with the length it
    was built for and a flag that it was rebuilt, rebinding all three when the length changes,
    and reads all three."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.table, self.built_for, self.rebuilt = torch.ones(1, dtype=D), 1, False

    def forward(self, x):
        n = x.shape[0]
        if n != self.built_for:
            self.table = torch.linspace(0.5, 1.5, n, dtype=D)
            self.built_for, self.rebuilt = n, True
        return torch.tanh(self.lin(x)) * self.table[:, None] * (2.0 if self.rebuilt else 1.0)


@pytest.mark.parametrize("how", ["backward", "torch.func.grad"])
def test_a_cached_tensor_attribute_and_its_flags_are_recomputed_from_their_values_at_the_call(how):
    """Where the forward run rebinds a module's tensor attribute, the recomputation gets it as at
    the call, and the plain attributes the run rebound with it (the length, the flag) too: it
    rebuilds the table as the forward run did and computes the same values. Afterwards the module
    holds the forward run's state, as without remat."""
    import copy

    torch.manual_seed(0)
    reference = _CachesATableForItsLength()
    net = copy.deepcopy(reference)

    def grads(m, module, n):
        x = torch.linspace(-1, 1, 4 * n, dtype=D).view(n, 4)
        if how == "backward":
            module.zero_grad()
            m(x).square().sum().backward()
            return {k: p.grad.clone() for k, p in module.named_parameters()}
        params = {k: v.detach() for k, v in module.named_parameters()}
        return tf.grad(lambda p: tf.functional_call(m, p, (x,)).square().sum())(params)

    for n in (3, 3, 5, 2):
        assert_close(grads(remat(net), net, n), grads(reference, reference, n))
        assert (net.built_for, net.rebuilt) == (reference.built_for, reference.rebuilt)
        assert_close(net.table, reference.table)


class _ShrinksItsWeight(torch.nn.Module):
    """Rebinds its weight's ``.data`` in its forward (weight decay, then clipping, written as
    ``w.data = ...``: new memory, as ``Module.to`` makes), then reads it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(5)))

    def forward(self, x):
        self.w.data = (self.w.data * 0.9).clamp(-0.5, 0.5)
        return torch.tanh(x @ self.w)


@pytest.mark.parametrize("x_requires_grad", [False, True])  # (with a non-differentiable input, a write watch runs)
@pytest.mark.parametrize("route", ["remat", "remat(Sequential)"])
def test_a_data_setter_on_a_parameter_in_the_forward_reaches_the_parameter(route, x_requires_grad):
    """``w.data = ...`` inside the call lands on the module's parameter, as without remat, once per
    forward pass: the recomputation starts from the old values (the update is not idempotent).
    The second step starts from the first one's weights; the gradients are the plain module's."""
    import copy

    reference = torch.nn.Sequential(_ShrinksItsWeight(), _ShrinksItsWeight())
    net = copy.deepcopy(reference)
    model = torch.nn.Sequential(*[remat(layer) for layer in net]) if route == "remat" else remat(net)
    for _ in range(2):
        for m in (reference, model):
            x = X.clone().requires_grad_(x_requires_grad)
            m(x).square().sum().backward()
        assert_close(dict(net.named_parameters()), dict(reference.named_parameters()))
        assert_close(dict((k, p.grad) for k, p in net.named_parameters()), dict((k, p.grad) for k, p in reference.named_parameters()))


@pytest.mark.filterwarnings("error:The .grad attribute of a Tensor that is not a leaf")
def test_module_to_its_own_dtype_inside_the_forward_keeps_its_parameters():
    """HF SwitchTransformers' router runs ``self.classifier = self.classifier.to(router_dtype)`` in
    its forward: with the classifier in that dtype already, the parameters stay the module's own,
    the gradients are the plain module's, and remat's recomputation warns of nothing."""
    import copy

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(4, 3, dtype=D)

        def forward(self, x):
            self.classifier = self.classifier.to(D)
            return self.classifier(x)

    reference = Router()
    net = copy.deepcopy(reference)
    params = list(net.parameters())
    for m in (reference, remat(net)):
        m(X).square().sum().backward()
    assert all(p is q for p, q in zip(net.parameters(), params))
    assert_close(dict((k, p.grad) for k, p in net.named_parameters()), dict((k, p.grad) for k, p in reference.named_parameters()))


def test_module_to_another_dtype_inside_the_forward_raises_in_the_forward_pass():
    """Converting a parameter to another dtype inside the call (``Module.to`` sets ``param.data``)
    cannot reach the caller's graph, built for the old dtype: a clear error, not a parameter
    silently left in its old dtype."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(4, 3, dtype=D)

        def forward(self, x):
            self.classifier = self.classifier.to(torch.float32)
            return self.classifier(x.float()).double()

    with pytest.raises(CheckpointError, match=r"set the \.data of Router's 'classifier.weight'.*router_dtype"):
        remat(Router())(X)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
def test_the_previous_steps_kept_tensor_read_as_a_number_inside_the_call():
    """A module logging last step's ``self.aux`` (whose backward has run) with ``.item()``,
    ``float()`` or a format string: a value read passes no gradient, as without remat."""

    class Aux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, dtype=D)
            self.aux, self.log, self.logging = None, [], False

        def forward(self, x):
            if self.logging:
                self.log.append((self.aux.item(), float(self.aux), f"{self.aux:.3f}", bool(self.aux)))
            h = self.lin(x)
            self.aux = h.square().mean()
            return h.tanh()

    reference = Aux()
    net = Aux()
    net.load_state_dict(reference.state_dict())
    for wrap, m in ((lambda m: m, reference), (remat, net)):
        for step in range(3):
            x = X * (step + 1)
            m.logging = step > 0
            y = wrap(m)(x)
            m.logging = False
            (y.sum() + m.aux).backward()
    assert len(reference.log) == 2 and net.log == reference.log
    assert_close(net.lin.weight.grad, reference.lin.weight.grad)


class _KeepsItsInput(torch.nn.Module):
    def __init__(self, keep):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.keep, self.last = keep, None

    def forward(self, x):
        self.last = self.keep(self, x)
        return self.lin(x).tanh()


@pytest.mark.parametrize(
    "keep",
    [lambda m, x: x, lambda m, x: m.lin.weight, lambda m, x: [x]],
    ids=["the input", "its own weight", "a list of the input"],
)
def test_a_module_storing_an_input_on_itself_raises(keep):
    """``self.last = x``: the function gets remat's own copy of x, so a loss through
    ``m.last`` silently missed x's gradient (and the weight's, for ``self.w = self.lin.weight``)."""
    m = _KeepsItsInput(keep)
    with pytest.raises(CheckpointError, match="stored one of its inputs .* a module attribute"):
        remat(m)(X.clone().requires_grad_())


def test_a_module_storing_a_copy_of_its_input_over_steps():
    reference = _KeepsItsInput(lambda m, x: x.clone())
    net = _KeepsItsInput(lambda m, x: x.clone())
    net.load_state_dict(reference.state_dict())
    for step in range(3):
        grads = []
        for wrap, m in ((lambda m: m, reference), (remat, net)):
            x = (X * (step + 1)).requires_grad_()
            loss = wrap(m)(x).sum() + m.last.square().sum()
            grads.append(torch.autograd.grad(loss, [x, m.lin.weight]))
        assert_close(grads[1], grads[0])


def _passing_through(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):  # (HF's @can_return_tuple, @deprecate_kwarg: a wrapper's code)
        return method(*args, **kwargs)

    return wrapper


class _KeepsItsInputDecorated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)

    @_passing_through
    def forward(self, x):
        self.last = x
        return self.lin(x).tanh()


class _KeepsItsInputBySetattr(_KeepsItsInputDecorated):
    def forward(self, x):
        setattr(self, "last", x)
        return self.lin(x).tanh()


@pytest.mark.parametrize("module", [_KeepsItsInputDecorated, _KeepsItsInputBySetattr])
def test_a_module_storing_its_input_however_its_class_writes_it_raises(module):
    with pytest.raises(CheckpointError, match="stored one of its inputs .* a module attribute"):
        remat(module())(X.clone().requires_grad_())


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_a_closure_tensor_of_the_caller_given_to_a_transform_inside_raises_saying_to_pass_it(transform):
    """A tensor of the caller's transform, reached through the closure and given to a torch.func
    transform inside the function (a MAML inner step closing over the task's data): that transform
    wraps it itself, where remat cannot route it, and torch's internal assert failed. remat says
    what to do; passing the tensor as an argument gives the function's own result."""
    w = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(0))
    xs = torch.randn(2, 3, dtype=D, generator=torch.Generator().manual_seed(1))

    def loss(w, x):
        return torch.sin(w * x).sum()

    def run(inner):
        if transform == "grad":
            return tf.grad(lambda x: inner(x).pow(2).sum())(xs[0])
        return tf.jvp(inner, (xs[0],), (xs[1],))[1]

    with pytest.raises(CheckpointError, match="Pass that tensor to the remat'd function as an argument"):
        run(lambda x: remat(lambda q: tf.grad(loss)(q, x))(w))
    expected = run(lambda x: tf.grad(loss)(w, x))
    assert_close(run(lambda x: remat(lambda q, x: tf.grad(loss)(q, x))(w, x)), expected)


# ------------------------------------------------- what the walk finds, told without the walk


def _wrapped(fn, extra=None):
    """A decorator's wrapper around ``fn`` (as transformers wraps a layer's forward), holding
    ``extra`` and a flag in its closure and naming a logger."""

    flag = True

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if flag and extra is not None:
            LOGGER.debug("%s", type(extra))
        return fn(*args, **kwargs)

    return wrapper


def _chain(fn, depth, extra=None):
    """``depth`` wrappers around ``fn``, the innermost holding ``extra``."""
    fn = _wrapped(fn, extra)
    for _ in range(depth - 1):
        fn = _wrapped(fn)
    return fn


def _plain_block(x):
    return x.sin()


def _helper_reading_a_global(x):
    return x @ GLOBAL_W


def _calls_the_helper(x):
    return _helper_reading_a_global(x).tanh()


def _reads_math(x):
    return x * math.pi + functools.reduce(operator.add, [x, x])


def _recursive(x, n=2):
    return x if n == 0 else _recursive(x.sin(), n - 1)


def _keyword_default(x, *, w=GLOBAL_W):
    return x @ w


def _closures():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    generator = torch.Generator().manual_seed(0)
    return {
        "three wrappers": _chain(_plain_block, 3),
        "three wrappers, the innermost holding a tensor": _chain(_plain_block, 3, w),
        "three wrappers, one holding a module": _chain(_plain_block, 3, _mlp()),
        "three wrappers, one holding a logger": _chain(_plain_block, 3, LOGGER),
        "three wrappers, one holding a generator": _chain(_plain_block, 3, generator),
        "three wrappers, one holding a list": _chain(_plain_block, 3, [w]),
        "a helper reading a global tensor": _calls_the_helper,
        "a wrapped helper reading a global tensor": _wrapped(_calls_the_helper),
        "a recursive function": _recursive,
        "a function reading a Python module of the user's": _reads_a_user_module,
        "a function reading math.pi": _reads_math,
        "a keyword default": _wrapped(_keyword_default),
        "forty wrappers": _chain(_plain_block, 40),
        "forty wrappers, the innermost holding a tensor": _chain(_plain_block, 40, w),
    }


def _found(captured):
    return (
        [id(t) for t in captured.tensors],
        [id(g) for g in captured.generators],
        [(id(m), list(named)) for m, named in captured.modules],
    )


@pytest.mark.parametrize("case", list(_closures()))
@pytest.mark.parametrize("as_forward", [False, True], ids=["function", "a module's forward"])
def test_what_a_function_reaches_is_the_same_with_or_without_the_walk(case, as_forward, monkeypatch):
    """Where a function reaches nothing (its closure, defaults and globals hold only numbers,
    strings, loggers and functions of which the same is true), remat tells so without walking; it
    finds the same as the walk, which is what decides anything else."""
    from funckpt import _capture

    fn = _closures()[case]
    if as_forward:
        module = type("Wrapped", (torch.nn.Linear,), {"forward": lambda self, x: fn(x)})(4, 4, dtype=D)
        module.forward_fn = fn  # (the walk reaches fn through the module's class's forward, which closes over it)
        target = module
    else:
        target = fn
    told = _found(_capture.find_captured(target))
    monkeypatch.setattr(_capture, "_reaches_nothing", lambda fn: False)
    assert told == _found(_capture.find_captured(target))


def test_a_tensor_a_decorators_wrapper_of_a_modules_forward_holds_gets_its_gradient():
    scale = torch.tensor(1.5, dtype=D, requires_grad=True)

    def scaled(forward):
        @functools.wraps(forward)
        def wrapper(self, x):
            return forward(self, x) * scale

        return wrapper

    class Layer(torch.nn.Linear):
        forward = _wrapped(scaled(torch.nn.Linear.forward))

    layer = Layer(4, 4, dtype=D)
    params = [*layer.parameters(), scale]
    expected = _backward_grads(lambda: layer(X).tanh(), params)
    assert_close(_backward_grads(lambda: remat(layer)(X).tanh(), params), expected)


def test_a_tensor_a_user_function_holds_behind_torchs_own_decorator_gets_its_gradient():
    """torch's decorators (here enable_grad's) wrap the user's function in library code whose
    closure holds it: walked as the user's."""
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    @torch.enable_grad()
    def project(x):
        return x @ w

    expected = _backward_grads(lambda: project(X).tanh(), [w])
    assert_close(_backward_grads(lambda: remat(lambda x: project(x).tanh())(X), [w]), expected)


class _Config:
    """An attribute bag that answers every attribute read in Python (as an HF config does)."""

    def __init__(self):
        object.__setattr__(self, "reads", [])

    def __getattribute__(self, name):
        object.__getattribute__(self, "reads").append(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize(
    "obj",
    [torch.Generator(), torch.zeros(1), torch.nn.Parameter(torch.zeros(1)), None, 1, "s", [], _Config(), LOGGER],
    ids=lambda o: type(o).__name__,
)
def test_is_generator_agrees_with_isinstance(obj):
    from funckpt._capture import is_generator

    assert is_generator(obj) == isinstance(obj, torch.Generator)


def test_a_modules_generator_is_replayed_beside_an_attribute_bag():
    """A generator held as a module attribute next to a config object: found (its draws are
    replayed), and the config is not asked for its class."""

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = _Config()
            self.gen = torch.Generator().manual_seed(5)

        def forward(self, x):
            return x * torch.rand(x.shape, generator=self.gen, dtype=D)

    module = Noisy()
    x = X.clone().requires_grad_()
    module.gen.manual_seed(5)
    expected = torch.autograd.grad(module(x).sum(), x)
    module.gen.manual_seed(5)
    module.config.reads.clear()
    assert_close(torch.autograd.grad(remat(module)(x).sum(), x), expected)
    assert "__class__" not in module.config.reads


@pytest.mark.parametrize("route", ["backward", "torch.func.grad"])
def test_a_captured_tensor_inside_a_list_or_an_index_is_routed(route):
    """Operators given lists and index tuples (torch.cat of an input, an intermediate and a
    captured tensor; x[..., :n] and x[(i, ...)] with a captured index) see the captured tensor
    in its place there too."""
    w = torch.randn(3, 4, dtype=D, requires_grad=True)
    rows = torch.tensor([2, 0])

    def f(x, mask):
        h = torch.cat([x, x.sin(), w], dim=0)[..., :3]
        return (torch.stack((h[(rows, ...)].sum(0), h.sum(0))) * mask[..., :3]).tanh().sum()

    x, mask = X.clone(), torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)
    if route == "backward":
        expected = torch.autograd.grad(f(x.requires_grad_(), mask), (x, w))
        assert_close(torch.autograd.grad(remat(f)(x, mask), (x, w)), expected)
    else:
        g = lambda fn: tf.grad(lambda x, w_: fn(x, mask), argnums=(0,))(x, w)  # noqa: E731
        assert_close(g(remat(f)), g(f))


def _proxy(wrapped):
    """A forwarding proxy that reports the class of what it wraps and holds it where no walk
    looks (no ``__dict__`` or slot of its own), as wrapt's ObjectProxy does."""

    class Proxy:
        __slots__ = ()
        __class__ = property(lambda self: type(wrapped))
        __wrapped__ = property(lambda self: wrapped)

        def __getattr__(self, name):
            return getattr(wrapped, name)

    return Proxy()


def test_is_generator_agrees_with_isinstance_for_a_proxy():
    from funckpt._capture import is_generator

    assert is_generator(_proxy(torch.Generator())) and isinstance(_proxy(torch.Generator()), torch.Generator)
    assert not is_generator(_proxy(torch.zeros(1)))


@pytest.mark.parametrize("held", ["module attribute", "closure", "argument"])
def test_a_generator_behind_a_proxy_is_replayed(held):
    """A generator held through a proxy (wrapt's ObjectProxy) is a generator to isinstance: its
    draws are replayed. The output's value does not depend on them, its gradient does: a
    recomputation drawing anew would give a wrong gradient silently."""
    proxy = _proxy(torch.Generator().manual_seed(5))

    def noisy(x, gen):
        y = x * torch.rand(x.shape, generator=gen.__wrapped__, dtype=D)
        return x + (y - y.detach())

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gen = proxy

        def forward(self, x):
            return noisy(x, self.gen)

    fn, args = {
        "module attribute": (Noisy(), ()),
        "closure": (lambda x: noisy(x, proxy), ()),
        "argument": (noisy, (proxy,)),
    }[held]
    x = X.clone().requires_grad_()
    proxy.manual_seed(5)
    expected = torch.autograd.grad(fn(x, *args).sum(), x)
    proxy.manual_seed(5)
    assert_close(torch.autograd.grad(remat(fn)(x, *args).sum(), x), expected)
    proxy.manual_seed(5)
    assert_close(tf.grad(lambda x: remat(fn)(x, *args).sum())(X), expected[0])


class _Twice(torch.autograd.Function):
    """A custom Function (HF SEW-D's dropout): its apply passes no torch-function mode."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_a_partials_tensor_given_to_a_custom_function(how):
    """HF's checkpointing calls ``checkpoint(partial(layer.forward, **kwargs), *args)``; a keyword
    tensor the layer hands to a custom Function is the call's argument, routed as one."""

    def layer(h, rel):
        return (h * _Twice.apply(rel)).sin()

    def grads(wrap):
        w = torch.randn(4, dtype=D, requires_grad=True, generator=torch.Generator().manual_seed(0))
        h = torch.randn(4, dtype=D, requires_grad=True, generator=torch.Generator().manual_seed(1))
        rel = w * 1.5
        fn = functools.partial(layer, rel=rel) if how == "keyword" else functools.partial(lambda r, x: layer(x, r), rel)
        out = fn(h) if wrap is None else wrap(fn, h) if wrap is checkpoint else wrap(fn)(h)
        out.sum().backward()
        return h.grad, w.grad

    assert_close(grads(checkpoint), grads(None))
    assert_close(grads(remat), grads(None))


@pytest.mark.parametrize("transform", ["jacrev", "hessian", "vmap(grad)", "grad(vmap)", "vmap(jvp)", "backward"])
def test_a_remat_two_deep_gets_the_closure_tensors_of_the_run_around_it(transform):
    """Three remat'd functions nested in one another, the innermost reaching a tensor no derivative
    flows into through the closures. A run at a vjp or jvp level of its own (the outer one's
    recomputation under jacrev) holds it wrapped at that level; the run nested in it runs one level
    lower (its Function's forward lowered, with no transform left on the stack) and holds it as it
    is: what a call inside that one must get, not the wrapper of a level that is not on the stack."""
    b = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(7))
    w = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(8))

    def program(wrap):
        def inner(x):
            return x * b.sum() + b

        def middle(x):
            return wrap(inner)(x.sin()) + b

        def outer(x):
            return wrap(middle)(torch.tanh(x @ w)) * b

        return wrap(outer)

    def run(wrap):
        f = program(wrap)
        if transform == "jacrev":
            return tf.jacrev(f)(X[0])
        if transform == "hessian":
            return tf.hessian(lambda x: f(x).sin().sum())(X[0])
        if transform == "vmap(grad)":
            return tf.vmap(tf.grad(lambda x: f(x).sin().sum()))(X)
        if transform == "grad(vmap)":
            return tf.grad(lambda xs: tf.vmap(f)(xs).sin().sum())(X)
        if transform == "vmap(jvp)":
            return tf.vmap(lambda x: tf.jvp(f, (x,), (torch.ones_like(x),)))(X)
        x = X.clone().requires_grad_()
        f(x).sin().sum().backward()
        return x.grad

    assert_close(run(remat), run(lambda f: f))


def _nested_over_an_intermediate(variant, w, outer_policy, inner_policy, wrap, kept=None):
    """A remat'd function closing over ``h``, computed by the remat'd function it is called in."""

    def outer(x):
        h = (w @ x).sin()
        if kept is not None:  # (also kept outside the call: a real escape)
            kept.append(h)
        if variant == "closure":

            def inner(x_):
                return checkpoint_name(w @ (x_ * h), "h").tanh()

            return wrap(inner, inner_policy)(x) + h
        if variant == "not returned":  # h reaches the result through the nested call alone

            def inner(x_):
                return (w @ (x_ * h)).tanh()

            return wrap(inner, inner_policy)(x) * 2
        if variant == "partial":  # reached through a partial's arguments, not a closure

            def inner_of(x_, h_):
                return (w @ (x_ * h_)).tanh()

            return wrap(functools.partial(inner_of, h_=h), inner_policy)(x) + h
        if variant == "called twice":

            def inner(x_):
                return (w @ (x_ * h)).tanh()

            f = wrap(inner, inner_policy)
            return f(f(x)) + h
        assert variant == "two deep"  # the innermost closes over both enclosing runs' intermediates

        def middle(x_):
            g = (w @ x_).cos()

            def innermost(y):
                return (w @ (y * h * g)).tanh()

            return wrap(innermost, inner_policy)(x_) * g

        return wrap(middle, inner_policy)(x) + h

    return wrap(outer, outer_policy)


def _grads_of_nested(transform, variant, outer_policy, inner_policy, wrap, kept=None):
    w0 = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(5))

    def f(w, x):
        return _nested_over_an_intermediate(variant, w, outer_policy, inner_policy, wrap, kept)(x).sin()

    if transform in ("vmap then backward", "backward"):
        w = w0.clone().requires_grad_()
        out = tf.vmap(lambda x: f(w, x).sum())(X) if transform == "vmap then backward" else f(w, X[0])
        out.sum().backward()
        return w.grad
    if transform == "grad(vmap)":
        return tf.grad(lambda w: tf.vmap(lambda x: f(w, x).sum())(X).sum())(w0)
    if transform == "vmap(grad)":
        return tf.vmap(lambda x: tf.grad(lambda w: f(w, x).sum())(w0))(X)
    if transform == "jacrev":
        return tf.jacrev(lambda w: f(w, X[0]))(w0)
    if transform in ("vmap(jvp)", "jvp(vmap)"):  # (forward mode: the tangents)
        t = torch.ones_like(w0)
        if transform == "vmap(jvp)":
            return tf.vmap(lambda x: tf.jvp(lambda w: f(w, x), (w0,), (t,)))(X)
        return tf.jvp(lambda w: tf.vmap(lambda x: f(w, x))(X), (w0,), (t,))
    if transform == "jacrev(vmap)":
        return tf.jacrev(lambda w: tf.vmap(lambda x: f(w, x))(X))(w0)
    assert transform == "vmap(jacrev)"
    return tf.vmap(lambda x: tf.jacrev(lambda w: f(w, x))(w0))(X)


_NESTED_TRANSFORMS = [
    "vmap then backward",
    "grad(vmap)",
    "vmap(grad)",
    "jacrev",
    "jacrev(vmap)",
    "vmap(jacrev)",
    "vmap(jvp)",
    "jvp(vmap)",
    "backward",
]
_NESTED_POLICIES = [
    (None, None),
    (None, policies.everything_saveable),
    (policies.everything_saveable, None),
    (policies.dots_saveable, policies.nothing_saveable),
    (policies.everything_saveable, policies.everything_saveable),
]
_POLICY_IDS = [f"{getattr(o, '__name__', o)}-{getattr(i, '__name__', i)}" for o, i in _NESTED_POLICIES]


@pytest.mark.parametrize("policy", _NESTED_POLICIES, ids=_POLICY_IDS)
@pytest.mark.parametrize("variant", ["closure", "partial", "not returned", "called twice", "two deep"])
@pytest.mark.parametrize("transform", _NESTED_TRANSFORMS)
def test_a_nested_remat_closing_over_an_intermediate_of_the_run_around_it(transform, variant, policy):
    """The nested region holds the enclosing run's tensor it closes over as one of its inputs: no
    escape. Under a transform the enclosing run's outputs carry, until its Function's node takes
    them, the graph it recorded below its levels (grad mode on, as the caller's), with the nested
    region's node, its function and that tensor: it was refused as kept outside the call (vmap then
    backward; grad(vmap) two deep). Under jvp(vmap) two deep, the nested call's own look for a
    tangent on its inputs counted the caller's tangent of ``w`` as made by the run around it."""
    outer_policy, inner_policy = policy

    def with_remat(f, p):
        return remat(f, policy=p)

    def without(f, p):
        return f

    assert_close(
        _grads_of_nested(transform, variant, outer_policy, inner_policy, with_remat),
        _grads_of_nested(transform, variant, outer_policy, inner_policy, without),
    )


@pytest.mark.parametrize("policy", [(None, None), (policies.everything_saveable, None), (policies.dots_saveable, policies.nothing_saveable)], ids=_POLICY_IDS[:1] + _POLICY_IDS[2:4])
@pytest.mark.parametrize("variant", ["closure", "two deep"])
@pytest.mark.parametrize("transform", ["vmap then backward", "grad(vmap)", "vmap(grad)", "jacrev"])
def test_an_intermediate_a_nested_remat_closes_over_is_refused_where_also_kept_outside(transform, variant, policy):
    """What the nested regions hold is let go of, not excused: the same tensor appended to a list
    outside the call still escapes it, and its derivative would be silently missing."""
    kept: list[torch.Tensor] = []
    with pytest.raises(CheckpointError, match="outlived the call"):
        _grads_of_nested(transform, variant, *policy, lambda f, p: remat(f, policy=p), kept)


class _Log:
    """An object a function reaches through its closure (as a layer reaches its model), holding a
    list the code around its call appends to."""

    def __init__(self):
        self.entries = []


_W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(11))
_XS = torch.randn(3, 2, 4, dtype=D, generator=torch.Generator().manual_seed(12))


def _backward(f):
    w = _W.clone().requires_grad_()
    out = f(w, _XS[0])
    out.sum().backward()
    return out.detach(), w.grad


def _vmap_then_backward(f):
    w = _W.clone().requires_grad_()
    out = tf.vmap(f, in_dims=(None, 0))(w, _XS)
    out.sum().backward()
    return out.detach(), w.grad


def _vjp(f):
    out, vjp_fn = tf.vjp(lambda w: f(w, _XS[0]), _W)
    return out, vjp_fn(torch.ones_like(out))


def _jacrev(f):
    twice = lambda y: (y, y)  # noqa: E731 - the output, and the output again as the aux value
    return tf.jacrev(lambda w: twice(f(w, _XS[0])), has_aux=True)(_W)


#: The value of ``f(w, x)`` and its gradient (or jacobian) with respect to ``w``, each way.
_DIFFERENTIATED = {
    "backward": _backward,
    "grad": lambda f: tf.grad_and_value(lambda w: f(w, _XS[0]).sum())(_W),
    "vjp": _vjp,
    "vmap(grad)": lambda f: tf.vmap(tf.grad_and_value(lambda w, x: f(w, x).sum()), in_dims=(None, 0))(_W, _XS),
    "grad(vmap)": lambda f: tf.grad_and_value(lambda w: tf.vmap(f, in_dims=(None, 0))(w, _XS).sum())(_W),
    "jacrev": _jacrev,
    "vmap then backward": _vmap_then_backward,
}


class _Layer(torch.nn.Module):
    """A layer whose forward calls a function (remat'd or not) on its linear's output."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(13)))
            self.lin.bias.copy_(torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(14)))

    def forward(self, w, x):
        return self.inner(w, self.lin(x)).sin()


def _logged_layer(wrap, logger, policy=None, reads=False):
    """``f(w, x)``: a layer (remat'd by ``wrap``) whose inner function (remat'd too) reaches a log,
    which a forward hook on the layer or the caller (``logger``) appends the layer's output to.
    ``reads``: the inner function reads the last entry of the log, once there is one."""
    log = _Log()

    def inner(w, h):
        out = torch.tanh(h @ w)
        if reads and log.entries:
            out = out + log.entries[-1]
        return out

    layer = _Layer(wrap(inner, None))
    if logger == "a forward hook":
        layer.register_forward_hook(lambda module, args, output: log.entries.append(output))
        return wrap(layer, policy)
    ours = wrap(layer, policy)

    def f(w, x):
        y = ours(w, x)
        log.entries.append(y)
        return y

    return f


def _with_remat(f, policy):
    return remat(f, policy=policy)


def _without_remat(f, policy):
    return f


@pytest.mark.parametrize("policy", [None, policies.everything_saveable], ids=["no policy", "everything_saveable"])
@pytest.mark.parametrize("logger", ["a forward hook", "the caller"])
@pytest.mark.parametrize("how", list(_DIFFERENTIATED))
def test_a_nested_call_reaching_the_list_the_layers_output_is_logged_to(how, logger, policy):
    """A remat'd layer's inner remat'd function reaches, through its closure, the list its layer's
    output is appended to after the call. In the layer's recomputation the inner call finds that
    output there: a differentiable tensor it did not reach at the call, and never reads. No
    rebound closure (it was refused as one), and no input of the inner call (taken as one, it was
    a tensor of the caller's level, one level above the recomputation: a raw functorch error; or,
    under plain autograd, the layer's own output, read where a kept value shares its memory)."""
    differentiate = _DIFFERENTIATED[how]
    expected = differentiate(_logged_layer(_without_remat, logger, policy))
    assert_close(differentiate(_logged_layer(_with_remat, logger, policy)), expected)


@pytest.mark.parametrize("how", list(_DIFFERENTIATED))
def test_a_function_reaching_the_list_its_output_is_logged_to(how):
    """The same without nesting: what the caller logged since the call is reached, not read."""

    def program(wrap):
        log = _Log()

        def block(w, h):
            log  # (reaches the log, as a layer reaches its model)
            return torch.tanh(h @ w)

        g = wrap(block, None)

        def f(w, x):
            y = g(w, x)
            log.entries.append(y)
            return y.sin()

        return f

    differentiate = _DIFFERENTIATED[how]
    expected = differentiate(program(_without_remat))
    assert_close(differentiate(program(_with_remat)), expected)


@pytest.mark.parametrize("logger", ["a forward hook", "the caller"])
@pytest.mark.parametrize("how", list(_DIFFERENTIATED))
def test_a_nested_call_reading_what_was_logged_since_the_call_raises(how, logger):
    """Read, what was logged since the call changes the recomputation: remat refuses it (a
    CheckpointError, not a raw functorch error nor a wrong gradient), which says the tensor was
    kept outside the call or reached only since it."""
    with pytest.raises(CheckpointError, match="kept outside that call|appended since to a list"):
        _DIFFERENTIATED[how](_logged_layer(_with_remat, logger, reads=True))


def test_a_closure_tensor_rebound_that_the_function_no_longer_reads_is_no_error():
    """The function reaches a closure cell rebound since the call, but reads it only on a branch it
    does not take: nothing of the recomputation changes, as without remat."""
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    scale = torch.ones(4, dtype=D, requires_grad=True)

    def f(x, scaled=False):
        return torch.tanh(x @ w) * (scale if scaled else 1)

    y = remat(f)(X)
    scale = torch.full((4,), 2.0, dtype=D, requires_grad=True)  # noqa: F841 - rebinds f's cell
    y.sum().backward()
    assert_close(w.grad, torch.autograd.grad(f(X).sum(), w)[0])


def test_a_closure_tensor_returned_as_it_is_and_rebound_raises():
    """No operator receives a closure tensor the function returns untouched: the recomputation
    returning the tensor rebound since the call is refused all the same."""
    w = torch.randn(4, dtype=D, requires_grad=True)

    def f(x):
        return x.sin(), w

    y, v = remat(f)(X[0].clone().requires_grad_())
    w = torch.randn(4, dtype=D, requires_grad=True)  # noqa: F841 - rebinds f's cell
    with pytest.raises(CheckpointError, match="was rebound"):
        (y * v).sum().backward()


@pytest.mark.parametrize(
    "policy",
    [None, policies.everything_saveable, policies.memory_budget(0.5)],
    ids=["no policy", "everything_saveable", "memory_budget"],
)
def test_a_nested_call_reaching_the_inputs_a_norms_hook_records_under_plain_autograd(policy):
    """A LayerNorm called inside a nested remat'd function and after it, whose forward hook records
    its inputs in a list the nested function reaches. In the outer recomputation the nested call
    finds there the outer call's own intermediate, kept outside it (a tensor of the outer's node):
    taken as an input, it shared its memory with the value the outer policy kept, and the nested
    call's output was rebuilt as a view of it, which the outer run then refused as foreign."""

    def grads(wrap):
        log = _Log()
        norm = torch.nn.LayerNorm(4, dtype=D)
        norm.register_forward_hook(lambda module, args, output: log.entries.append(args[0]))

        def inner(w, h):
            log  # (reaches the log, as a layer reaches its model)
            return torch.tanh(h @ w) + norm(h)

        def chain(w, x):
            return norm(wrap(inner, None)(w, x)).sin()

        w = _W.clone().requires_grad_()
        wrap(chain, policy)(w, _XS[0]).sum().backward()
        return w.grad, norm.weight.grad, norm.bias.grad

    assert_close(grads(_with_remat), grads(_without_remat))


@pytest.mark.parametrize("read", ["detach", "data", "sign", "tolist"])
@pytest.mark.parametrize("determinism_check", ["default", "none"])
def test_a_closure_tensor_rebound_and_read_detached_raises(read, determinism_check):
    """A recomputation refuses a closure tensor rebound since the call also where it reads it
    detached or as Python numbers (a straight-through estimator, whose values do not show the
    rebinding; any such read where the determinism check is off): the gradient would follow the
    new tensor's values."""
    w = torch.tensor([2.0, -3.0, 4.0, 5.0], dtype=D, requires_grad=True)

    def f(x):
        s = {
            "detach": lambda: w.detach(),
            "data": lambda: w.data,
            "sign": lambda: w.sign(),
            "tolist": lambda: torch.tensor(w.tolist(), dtype=D),
        }[read]()
        return x + (x * s - (x * s).detach())

    y = remat(f, determinism_check=determinism_check)(X.clone().requires_grad_())
    w = torch.tensor([20.0, 30.0, -40.0, 50.0], dtype=D, requires_grad=True)  # noqa: F841 - rebinds f's cell
    with pytest.raises(CheckpointError, match="was rebound"):
        y.sum().backward()


def test_a_gradient_hook_reading_a_closure_tensor_rebound_since_the_call_reads_it_as_without_remat():
    """A gradient hook the function registers reads its closure when the backward pass runs it, without
    remat too: a closure tensor rebound since the call is the new one there, which is no error."""

    def f(x):
        h = x * 2
        if h.requires_grad:
            h.register_hook(lambda g: g * w)
        return h

    def grad(fn):
        nonlocal w
        w = torch.tensor([2.0, 3.0, 4.0, 5.0], dtype=D, requires_grad=True)
        x = X.clone().requires_grad_()
        y = fn(x)
        w = torch.tensor([20.0, 30.0, 40.0, 50.0], dtype=D, requires_grad=True)
        return torch.autograd.grad(y.sum(), x)[0]

    w = None
    assert_close(grad(remat(f)), grad(f))


@pytest.mark.parametrize("how", ["backward", "vjp"])
def test_a_closure_tensor_rebound_and_passed_to_a_nested_call_raises(how):
    """The recomputation passes a closure tensor rebound since the call to a remat'd function as an
    argument: Function.apply passes by the mode, so the nested call's arguments are asked. Taken,
    the gradient followed the new tensor and the old one's was missing."""
    inner = remat(lambda a, b: a + (a * b - (a * b).detach()))
    w = torch.tensor([2.0, 3.0, 4.0, 5.0], dtype=D, requires_grad=True)

    def f(x):
        return inner(x, w) * 2

    if how == "backward":
        y = remat(f)(X.clone().requires_grad_())
        w = torch.tensor([20.0, 30.0, 40.0, 50.0], dtype=D, requires_grad=True)  # noqa: F841
        with pytest.raises(CheckpointError, match="was rebound"):
            y.sum().backward()
    else:
        y, vjp_fn = tf.vjp(remat(f), X)
        w = torch.tensor([20.0, 30.0, 40.0, 50.0], dtype=D, requires_grad=True)  # noqa: F841
        with pytest.raises(CheckpointError, match="was rebound"):
            vjp_fn(torch.ones_like(y))


def test_a_logged_tensor_read_as_a_number_in_the_recomputation_is_no_error():
    """The function logs the previous step's loss (``aux[-1].item()``), to which the caller appends each
    step's: under grad, the recomputation reaches the step's own loss there. A read as a Python number
    is no use that the recomputation refuses."""
    aux = []
    seen = []

    def f(x):
        if aux:
            seen.append(aux[-1].item())
        return (x.sin() * 2).sum()

    def step(fn):
        def loss(x):
            out = fn(x)
            aux.append(out)
            return out

        return tf.grad(loss)(X[0])

    expected = [step(f) for _ in range(2)][-1]
    aux.clear()
    assert_close([step(remat(f)) for _ in range(2)][-1], expected)


def test_a_nested_call_closing_over_a_leaf_the_function_made_is_no_error():
    """The outer function reaches no tensor (its recomputation runs without the mode) and makes a leaf
    (``t.requires_grad_()``, as HF T5 does) that a remat'd function it calls closes over: the leaf is
    the run's own, not a tensor the run around the nested call would refuse."""

    def outer(x, wrap):
        t = (x * 3).detach()
        t.requires_grad_()
        return wrap(lambda y: y * t)(x).sin()

    x = X.clone().requires_grad_()
    expected = torch.autograd.grad(outer(x, lambda g: g).sum(), x)[0]
    assert_close(torch.autograd.grad(remat(lambda x: outer(x, remat))(x).sum(), x)[0], expected)


# --- A tensor the function reached at the call, found later where another one sat -------------------
# The recomputation swaps each captured tensor for its stand-in by identity: a list reordered between
# the forward and the backward pass has it compute with one tensor where the forward pass used
# another, and with equal values neither the determinism check nor the gradients' shapes show it.


def _twins():
    a = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(11)).requires_grad_()
    return a, a.detach().clone().requires_grad_()


def _reordered_list():
    a, b = _twins()
    lst = [a, b]
    return (lambda x: (lst[0] * x).sum()), lst.reverse


def _tuple_cell_rebuilt():
    a, b = _twins()
    pair = (a, b)

    def f(x):
        return (pair[1] * x).sum()

    def reorder():
        nonlocal pair
        pair = (b, a)

    return f, reorder


def _dict_values_swapped():
    a, b = _twins()
    d = {"p": a, "q": b}

    def reorder():
        d["p"], d["q"] = d["q"], d["p"]

    return (lambda x: (d["p"] * x).sum()), reorder


def _attributes_swapped():
    a, b = _twins()
    o = types.SimpleNamespace(u=a, v=b)

    def reorder():
        o.u, o.v = o.v, o.u

    return (lambda x: (o.u * x).sum()), reorder


REORDERED_GLOBAL = []


def _global_list_reversed():
    REORDERED_GLOBAL[:] = _twins()

    def f(x):
        return (REORDERED_GLOBAL[0] * x).sum()

    return f, REORDERED_GLOBAL.reverse


def _partial_argument_reversed():
    a, b = _twins()
    lst = [a, b]
    p = functools.partial(lambda ws, x: (ws[0] * x).sum(), lst)
    return (lambda x: p(x)), lst.reverse


def _inserted_before():
    a, b = _twins()
    lst = [a, b]
    return (lambda x: (lst[1] * x).sum()), lambda: lst.insert(0, torch.zeros(3, dtype=D))


def _returned_as_it_is():
    a, b = _twins()
    lst = [a, b]
    return (lambda x: ((x * 2).sum(), lst[0])), lst.reverse


_REORDERED = {
    "list reversed": _reordered_list,
    "tuple cell rebuilt": _tuple_cell_rebuilt,
    "dict values swapped": _dict_values_swapped,
    "attributes swapped": _attributes_swapped,
    "global list reversed": _global_list_reversed,
    "partial argument reversed": _partial_argument_reversed,
    "inserted before": _inserted_before,
    "returned as it is": _returned_as_it_is,
}


def _total(out):
    return out if isinstance(out, torch.Tensor) else out[0] + out[1].sum()


def _reorder_then_differentiate(route, make, use_remat):
    """Call (the remat'd) function, reorder what it reads, then differentiate: the gradients."""
    fn, reorder = make()
    f = remat(fn) if use_remat else fn
    x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(12))
    if route == "backward":
        x.requires_grad_()
        out = _total(f(x))
        reorder()
        out.backward()
        return x.grad

    def called_then_reordered(x):
        out = _total(f(x))
        reorder()
        return out

    if route == "grad":
        return tf.grad(called_then_reordered)(x)
    if route == "vjp":
        out, pullback = tf.vjp(lambda x: _total(f(x)), x)
        reorder()
        return pullback(torch.ones((), dtype=D))[0]
    assert route == "vmap(grad)"
    return tf.vmap(tf.grad(called_then_reordered))(torch.stack([x, 2 * x]))


@pytest.mark.parametrize("route", ["backward", "grad", "vjp", "vmap(grad)"])
@pytest.mark.parametrize("case", list(_REORDERED))
def test_a_closure_tensor_moved_where_another_one_sat_raises(case, route):
    """Reordered (equal values), the recomputation would read b where the forward pass read a: a's
    gradient would go to b. A use of the moved tensor is refused, naming the place."""
    make = _REORDERED[case]
    with pytest.raises(CheckpointError, match="was replaced by another tensor it reached at the call elsewhere"):
        _reorder_then_differentiate(route, make, True)


def test_a_reordered_closure_list_names_the_place_and_what_to_do():
    fn, reorder = _reordered_list()
    y = remat(fn)(X[0, :3].clone().requires_grad_())
    reorder()
    with pytest.raises(CheckpointError, match=r"at 'lst\[0\]'.*Pass such tensors to the remat'd function as arguments, or do not reorder"):
        y.backward()


def _dict_rebuilt_in_another_order():
    a, b = _twins()
    d = {"p": a, "q": b}

    def f(x):
        return (d["p"] * x + d["q"] * x.sum()).sum()

    def rebuild():
        nonlocal d
        d = {"q": d["q"], "p": d["p"]}

    return f, rebuild


def _inserted_before_the_one_read():
    a, b = _twins()
    lst = [a, b]
    return (lambda x: (lst[-1] * x).sum()), lambda: lst.insert(0, torch.ones(3, dtype=D, requires_grad=True))


def _appended():
    a, b = _twins()
    lst = [a, b]
    return (lambda x: (lst[0] * x + lst[1]).sum()), lambda: lst.append(torch.ones(3, dtype=D, requires_grad=True))


def _moved_but_not_read():
    a, b = _twins()
    lst = [a, b]
    c = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(14)).requires_grad_()
    return (lambda x: (c * x).sum() + len(lst)), lst.reverse


def _equal_constants_swapped():
    a = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(15))
    lst = [a, a.clone()]
    return (lambda x: (lst[0] * x).sum()), lst.reverse


_NOT_REORDERED = {
    "dict rebuilt in another order": _dict_rebuilt_in_another_order,
    "inserted before the one read": _inserted_before_the_one_read,
    "appended": _appended,
    "moved but not read": _moved_but_not_read,
    "equal constants swapped": _equal_constants_swapped,
}


@pytest.mark.parametrize("route", ["backward", "grad", "vjp", "vmap(grad)"])
@pytest.mark.parametrize("case", list(_NOT_REORDERED))
def test_a_closure_container_changed_where_the_function_reads_the_same_tensors(case, route):
    """No false alarm: the function reads at the backward the tensors it read at the call."""
    make = _NOT_REORDERED[case]
    assert_close(_reorder_then_differentiate(route, make, True), _reorder_then_differentiate(route, make, False))


def test_a_closure_container_changed_keeps_the_closure_tensors_gradients():
    """The tensors the function read at the call get the gradients they get without remat."""
    for make in (_dict_rebuilt_in_another_order, _inserted_before_the_one_read, _appended):
        grads = []
        for use_remat in (False, True):
            fn, change = make()
            held = fn.__closure__[0].cell_contents
            held = list(held.values()) if isinstance(held, dict) else list(held)
            x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(13)).requires_grad_()
            out = (remat(fn) if use_remat else fn)(x)
            change()
            out.backward()
            grads.append([x.grad] + [t.grad for t in held])
        assert_close(grads[1], grads[0])


def test_a_closure_tensor_replaced_by_an_equal_constant_raises():
    """Replaced by a constant with the same values, the tensor there at the call would silently
    get no gradient (the determinism check sees the same values)."""
    a = torch.randn(3, dtype=D, requires_grad=True)
    box = [a]
    y = remat(lambda x: (box[0] * x).sum())(torch.randn(3, dtype=D, requires_grad=True))
    box[0] = a.detach().clone()
    with pytest.raises(CheckpointError, match=r"at 'box\[0\]'.*was rebound to a tensor it did not reach"):
        y.backward()


_JACREV_REBOUND = {}


def _reads_jacrev_rebound(x):
    return (_JACREV_REBOUND["w"] * x).sum()


def _rebinds_at_its_level(y):
    # A tensor of jacrev's level, with the values of the one there at the call: dead once jacrev returns.
    _JACREV_REBOUND["w"] = _JACREV_REBOUND["w"].detach() + 0 * y
    return y * 1.0


@pytest.mark.parametrize("route", ["backward", "grad"])
def test_a_closure_rebound_inside_jacrev_to_a_tensor_of_its_level_dead_by_the_backward_raises(route):
    """The recomputation would read the dead wrapper (its values, no gradient) where the forward
    pass read the tensor there at the call, whose gradient would silently be missing."""
    w = torch.randn(3, dtype=D, requires_grad=True)
    x = torch.randn(3, dtype=D, requires_grad=True)
    f = remat(_reads_jacrev_rebound)
    if route == "backward":
        _JACREV_REBOUND["w"] = w
        y = f(x)
        tf.jacrev(_rebinds_at_its_level)(torch.randn(3, dtype=D))
        with pytest.raises(CheckpointError, match=r"at \"_JACREV_REBOUND\['w'\]\".*was rebound"):
            y.backward()
        return

    def loss(x, w):
        _JACREV_REBOUND["w"] = w
        y = f(x)
        tf.jacrev(_rebinds_at_its_level)(torch.randn(3, dtype=D))
        return y

    with pytest.raises(CheckpointError, match="was rebound"):
        tf.grad(loss, argnums=(0, 1))(x.detach(), w.detach())


# --- A module the function reached at the call, found later where another one sat ------------------


def _twin_layers(container):
    layer = torch.nn.Linear(3, 3, dtype=D)
    generator = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=D, generator=generator))
    layers = [layer, type(layer)(3, 3, dtype=D)]
    layers[1].load_state_dict(layer.state_dict())  # (equal values: no check can tell them apart)
    return torch.nn.ModuleList(layers) if container == "ModuleList" else layers


def _reverse_modules(layers):
    if isinstance(layers, torch.nn.ModuleList):
        layers._modules["0"], layers._modules["1"] = layers._modules["1"], layers._modules["0"]
    else:
        layers.reverse()


@pytest.mark.parametrize("route", ["backward", "grad"])
def test_a_closure_list_of_modules_reordered_raises(route):
    """A plain list's modules keep their own stand-ins (reparametrized by owner): reordered, the
    recomputation would run the second where the forward pass ran the first, and the first's
    gradients would go to the second."""
    layers = _twin_layers("list")
    f = remat(lambda x: layers[0](x).square().sum())
    x = torch.randn(2, 3, dtype=D)
    with pytest.raises(CheckpointError, match=r"module at 'layers\[0\]'.*reached at the call elsewhere.*nn.ModuleList"):
        if route == "backward":
            y = f(x)
            _reverse_modules(layers)
            y.backward()
        else:
            tf.grad(lambda x: (f(x), _reverse_modules(layers))[0])(x)


def test_a_closure_dict_of_modules_swapped_raises():
    a, b = _twin_layers("list")
    d = {"p": a, "q": b}
    y = remat(lambda x: d["p"](x).square().sum())(torch.randn(2, 3, dtype=D))
    d["p"], d["q"] = d["q"], d["p"]
    with pytest.raises(CheckpointError, match=r"module at \"d\['p'\]\".*reached at the call elsewhere"):
        y.backward()


@pytest.mark.parametrize("change", ["ModuleList reordered", "list appended to"])
def test_a_closure_container_of_modules_changed_keeps_the_gradients(change):
    """A ModuleList reordered is looked up by name again (as functional_call would): the module now
    at index 0 runs with the parameters of the one there at the call, which get its gradients, as
    without remat. Appending to a plain list moves nothing."""
    grads = []
    for use_remat in (False, True):
        layers = _twin_layers("ModuleList" if change == "ModuleList reordered" else "list")
        params = [p for m in layers for p in m.parameters()]
        fn = lambda x: layers[0](x).square().sum()  # noqa: E731
        x = torch.randn(2, 3, dtype=D, generator=torch.Generator().manual_seed(16)).requires_grad_()
        y = (remat(fn) if use_remat else fn)(x)
        if change == "ModuleList reordered":
            _reverse_modules(layers)
        else:
            layers.append(torch.nn.Linear(3, 3, dtype=D))
        y.backward()
        grads.append([x.grad] + [p.grad for p in params])
    assert_close(grads[1], grads[0])


def test_a_closure_list_reordered_under_a_nested_remat_raises():
    """The inner call's recomputation (in the outer's backward) would read the moved tensor."""
    a, b = _twins()
    lst = [a, b]
    inner = remat(lambda x: (lst[0] * x).sin())
    y = remat(lambda x: inner(x * 2).sum())(torch.randn(3, dtype=D, requires_grad=True))
    lst.reverse()
    with pytest.raises(CheckpointError, match=r"at 'lst\[0\]'.*reached at the call elsewhere"):
        y.backward()


def test_a_closure_place_the_function_overwrites_with_what_it_made():
    """The function writes into a place it reaches (a tensor was there at the call): its own
    recomputation writes there again and never reads the forward run's, so nothing is refused."""
    grads = []
    for use_remat in (False, True):
        g = torch.Generator().manual_seed(18)
        w = torch.randn(3, dtype=D, generator=g).requires_grad_()
        state = [torch.randn(3, dtype=D, generator=g).requires_grad_()]

        def f(x):
            y = x * w
            state[0] = y.detach()
            return y.sum()

        x = torch.randn(3, dtype=D, generator=g).requires_grad_()
        (remat(f) if use_remat else f)(x).backward()
        grads.append([x.grad, w.grad])
    assert_close(grads[1], grads[0])


GRADIENT_LOG: list = []  # a hook's log of gradients, kept across transforms (a debugging habit)


def _logging_gradients(x, w):
    h = x @ w
    if h.requires_grad:
        h.register_hook(GRADIENT_LOG.append)
    return h.tanh()


def test_gradients_a_hook_logged_under_ended_transforms_are_not_routed_into_later_calls():
    """The log holds torch.func wrappers of levels that have ended (a vmap's of batch size 3, a grad's):
    the function reaches them through the global it names, but nothing can use them. Routed as inputs,
    they failed every later call (another vmap's batch size, a dead level); without remat each runs."""
    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 2, dtype=D)

    def steps(f):
        GRADIENT_LOG.clear()
        loss = lambda x, w: f(x, w).square().sum()  # noqa: E731
        per_example = lambda xs: tf.vmap(tf.grad(loss, argnums=1), in_dims=(0, None))(xs, w)  # noqa: E731

        def backward():
            w2 = w.clone().requires_grad_()
            loss(x, w2).backward()
            return w2.grad

        return [
            per_example(x.unsqueeze(1)),
            tf.jacrev(f, argnums=1)(x, w),
            per_example(torch.cat([x, x.cos()]).unsqueeze(1)),  # (another batch size)
            tf.grad(loss, argnums=1)(x, w),
            backward(),
            len(GRADIENT_LOG),
        ]

    assert_close(steps(remat(_logging_gradients)), steps(_logging_gradients))


class _ActNormThroughData(_ActNorm):
    """:class:`_ActNorm` writing through ``.data`` (no graph records it, as Glow's does): allowed in
    a call whose inputs all require grad, as the layer's own nested in a network is."""

    def forward(self, x):
        if not self.initialized:
            self.loc.data.copy_(-x.mean(0).detach())
            if not self.buffer:
                self.scale.data.copy_(1 / x.std(0).detach())
            self.initialized = True
        return (x + self.loc) * self.scale


@pytest.mark.parametrize("buffer", [False, True])
def test_a_write_in_place_guarded_by_a_flag_in_a_remat_nested_in_a_remat(buffer):
    """The same module remat'd itself inside a remat'd network (``remat(net)`` whose ``net.norm`` is
    ``remat(ActNorm)``): the outer call's recomputation starts from the written parameters as at
    its call, and so from the flag on the module the inner wrapper wraps as at that call too (the
    outer walk listed the wrapper, not the module whose attributes the inner call rebinds: the
    inner forward run, run again, skipped the initialization, a false "did not reproduce")."""
    import copy

    torch.manual_seed(0)
    reference = _NormedLinear(buffer)
    reference.norm.__class__ = _ActNormThroughData
    net = copy.deepcopy(reference)
    net.norm = remat(net.norm)
    model = remat(net)
    x = torch.randn(8, 4, dtype=D)
    for _ in range(2):
        for m, module in ((reference, reference), (model, net)):
            module.zero_grad()
            m(x).square().sum().backward()
        assert_close({k: p.grad for k, p in net.named_parameters()}, {k: p.grad for k, p in reference.named_parameters()})
        assert_close(net.state_dict(), reference.state_dict())
        assert net.norm.initialized and reference.norm.initialized
