"""The determinism check, debug traces, and state left behind by failures."""

import re
import warnings

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import _get_current_dispatch_mode

from funckpt import CheckpointError, policies, remat, set_checkpoint_debug_enabled
from funckpt import _capture

D = torch.float64
X = torch.randn(3, 4, dtype=D)


def shape_changing():
    """A function that returns a different shape on its second call."""
    calls = []

    def f(x):
        calls.append(1)
        return x.sum(0) if len(calls) > 1 else x * 2

    return f


def test_recomputation_with_another_shape_raises_naming_it():
    x = X.clone().requires_grad_()
    y = remat(shape_changing())(x)
    with pytest.raises(CheckpointError, match=r"shape was \(3, 4\) in the forward pass, \(4,\) in the recomputation"):
        y.sum().backward()


def test_recomputation_with_another_dtype_raises_under_torch_func():
    calls = []

    def f(x):
        calls.append(1)
        return x.float() if len(calls) > 1 else x * 1

    with pytest.raises(CheckpointError, match="dtype was torch.float64"):
        tf.grad(lambda x: remat(f)(x).sum())(X)


def test_debug_adds_both_operator_traces():
    x = X.clone().requires_grad_()
    y = remat(shape_changing(), debug=True)(x)
    with pytest.raises(CheckpointError, match=r"(?s)operator traces.*forward.*aten\.mul.*recomputation.*aten\.sum"):
        y.sum().backward()


def test_set_checkpoint_debug_enabled_overrides_the_argument():
    x = X.clone().requires_grad_()
    with set_checkpoint_debug_enabled(True):
        y = remat(shape_changing(), debug=False)(x)
        with pytest.raises(CheckpointError, match="operator traces"):
            y.sum().backward()
    with pytest.raises(TypeError, match="enabled"):
        with set_checkpoint_debug_enabled("yes"):
            pass


@pytest.mark.parametrize("backward_in", ["another_thread", "outside_the_with"])
def test_debug_is_decided_at_the_forward_run_as_torch_does(backward_in):
    """The override is per thread; the backward pass may run in another one (an autograd device
    thread on a GPU) or after the ``with``: the forward run's decision holds for both runs."""
    import threading

    x = X.clone().requires_grad_()
    errors = []

    def backward():
        try:
            y.sum().backward()
        except CheckpointError as e:
            errors.append(e)

    with set_checkpoint_debug_enabled(True):
        y = remat(shape_changing(), debug=False)(x)
        if backward_in == "another_thread":
            worker = threading.Thread(target=backward)
            worker.start()
            worker.join()
    if backward_in == "outside_the_with":
        backward()
    (error,) = errors
    assert re.search(r"(?s)operator traces.*forward.*aten\.mul.*recomputation.*aten\.sum", str(error))


def test_determinism_check_none_skips_the_check():
    x = X.clone().requires_grad_()
    y = remat(shape_changing(), determinism_check="none")(x)
    with pytest.raises(RuntimeError) as info:  # autograd itself then rejects the gradient's shape
        y.sum().backward()
    assert not isinstance(info.value, CheckpointError)


def test_in_place_update_of_a_differentiable_input_raises():
    def f(x):
        x.mul_(2)
        return x.sin()

    with pytest.raises(CheckpointError, match="modified .*differentiable inputs in place"):
        tf.grad(lambda x: remat(f)(x.clone() * 1).sum())(X)


def test_in_place_update_by_a_custom_function_marking_its_input_dirty_raises():
    """An ``autograd.Function`` writing the input in place (``ctx.mark_dirty``) is the same write
    as ``x.mul_(2)``: the same CheckpointError, not torch's words about a leaf."""

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            a.mul_(2)
            ctx.mark_dirty(a)
            return a

        @staticmethod
        def backward(ctx, g):
            return g * 2

    with pytest.raises(CheckpointError, match="modified .*differentiable inputs in place"):
        remat(lambda x: Double.apply(x).sin())(X.clone().requires_grad_() * 1)


_INPLACE_RELU = remat(torch.nn.ReLU(inplace=True))  # (as torchvision's MNASNet has one)


def _relu_in_place_loss(w, x):
    return _INPLACE_RELU(x @ w).sum()


@pytest.mark.parametrize(
    "transform",
    [
        lambda w, x: tf.vmap(tf.grad(_relu_in_place_loss), in_dims=(None, 0))(w, x),
        lambda w, x: tf.vmap(tf.jacrev(_relu_in_place_loss), in_dims=(None, 0))(w, x),
        lambda w, x: tf.vmap(lambda w, x: tf.vjp(_relu_in_place_loss, w, x)[1](torch.ones((), dtype=D)), in_dims=(None, 0))(w, x),
        lambda w, x: tf.hessian(_relu_in_place_loss)(w, x),
        lambda w, x: tf.vmap(tf.grad(lambda x: remat(lambda a: a.mul_(2).sin())(x.tanh()).sum()))(x),
    ],
    ids=["vmap(grad)", "vmap(jacrev)", "vmap(vjp)", "hessian", "vmap(grad) of a function"],
)
def test_in_place_update_of_a_differentiable_input_raises_under_vmap_and_hessian(transform):
    """The same CheckpointError as under grad and .backward(), not torch's raw refusal of a write
    to a leaf: the forward run at a grad level of its own gets its differentiable inputs as leaves."""
    with pytest.raises(CheckpointError, match="modified .*differentiable inputs in place"):
        transform(torch.randn(4, 4, dtype=D), X)


@pytest.mark.parametrize("write", ["direct", "through a view"])
def test_in_place_update_of_a_differentiable_input_raises_under_vmap_with_a_saving_policy(write):
    """With a policy the forward run records no graph of its own under vmap(grad): a write to a
    differentiable input is told from one through ``.data`` by the input's version counter."""

    def f(w, x):
        (w if write == "direct" else w[0]).mul_(2)
        return (x @ w).sin()

    def loss(w, x):
        return remat(f, policy=policies.dots_saveable)(w * 1, x).sum()

    with pytest.raises(CheckpointError, match="modified .*differentiable inputs in place"):
        tf.vmap(tf.grad(loss), in_dims=(None, 0))(torch.randn(4, 4, dtype=D), X)


def test_in_place_update_of_an_input_under_vmap_runs_as_without_remat():
    """Under vmap, a write to an input no gradient flows into is part of a correct program:
    with nothing requiring grad, nothing will be recomputed."""
    relu = torch.nn.ReLU(inplace=True)
    w = torch.randn(4, 4, dtype=D)
    assert_close(tf.vmap(lambda x: remat(relu)(x @ w).sum())(X), tf.vmap(lambda x: relu(x @ w).sum())(X))


def test_in_place_update_of_an_input_under_vmap_by_a_function_reaching_parameters():
    """Under vmap, a function reaching a module's parameters writes its (non-differentiated) input:
    the recomputation would start from a copy of the input as it was."""
    lin = torch.nn.Linear(4, 4, dtype=D)

    def f(a):
        a.mul_(2)
        return lin(a)

    def run(wrap):
        lin.zero_grad()
        out = tf.vmap(lambda x: wrap(f)(x.tanh()))(X)
        out.square().sum().backward()
        return out, [p.grad for p in lin.parameters()]

    assert_close(run(remat), run(lambda f: f))


def test_in_place_update_recorded_by_autograd_raises_beside_a_non_differentiable_input():
    """With an integer input beside it, the forward run's write watch sees the write first: one
    that autograd records changes the caller's graph, which remat cannot, so it still raises."""
    index = torch.tensor([0, 2])

    def f(x, i):
        x.mul_(2)
        return x.sin()[i]

    with pytest.raises(CheckpointError, match="modified .*differentiable inputs in place"):
        tf.grad(lambda x: remat(f)(x * 1, index).sum())(X)
    with pytest.raises(CheckpointError, match="modified .*differentiable inputs in place"):
        remat(f)(X.clone().requires_grad_() * 1, index).sum().backward()
    with pytest.raises(CheckpointError, match="differentiable inputs in place"):
        tf.jvp(lambda x: remat(f)(x, index), (X.clone(),), (torch.ones_like(X),))


def test_write_to_a_differentiable_input_under_no_grad_happens_once():
    """A write no graph records (under no_grad) is part of a correct program: the caller sees it
    done once, and the gradients are those of the operators after it, as without remat."""
    index = torch.tensor([0, 2])

    def f(x, i):
        with torch.no_grad():
            x.clamp_(-0.5, 0.5)
        return x.sin()[i] * x[i]

    def program(g):
        x0 = X.clone().requires_grad_()
        x = x0 * 1
        g(x, index).sum().backward()
        return x.detach(), x0.grad

    assert_close(program(remat(f)), program(f))
    loss = lambda g: lambda x: g(x * 1, index).sum()  # noqa: E731
    assert_close(tf.grad(loss(remat(f)))(X), tf.grad(loss(f))(X))


def test_in_place_update_of_a_buffer_happens_once():
    counter = torch.zeros(())

    def f(x):
        counter.add_(1)
        return x.sin() * 2

    x = X.clone().requires_grad_()
    remat(f)(x).sum().backward()
    assert counter.item() == 1


def _global_state():
    return (
        torch.is_grad_enabled(),
        torch.get_rng_state(),
        torch._C._len_torch_function_stack(),
        _get_current_dispatch_mode(),
        torch._C._functorch.peek_interpreter_stack(),
        list(_capture._active.substitutes),
        list(_capture._runs),  # runs holding module places
        dict(_capture._runs_by_thread),
    )


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
def test_failure_inside_recomputation_leaves_no_global_state_changed(transform):
    calls = []

    def f(x):
        calls.append(1)
        y = torch.nn.functional.dropout(x, 0.5)
        if len(calls) > 1:
            raise ValueError("boom in recomputation")
        return y

    g = remat(f, debug=True)
    torch.manual_seed(0)
    before = _global_state()
    with pytest.raises(ValueError, match="boom in recomputation"):
        if transform == "backward":
            g(X.clone().requires_grad_()).sum().backward()
        elif transform == "grad":
            tf.grad(lambda x: g(x).sum())(X)
        else:
            tf.vmap(tf.grad(lambda x: g(x).sum()), randomness="different")(X)
    after = _global_state()
    assert before[0] == after[0]
    assert before[2:] == after[2:]
    # the only RNG use is the forward's dropout: the failed recomputation restored the caller's state
    torch.manual_seed(0)
    torch.nn.functional.dropout(torch.empty_like(X) if transform != "vmap_grad" else X[0], 0.5)
    if transform != "vmap_grad":
        assert torch.equal(after[1], torch.get_rng_state())


class _RaisesOnCall(torch.nn.Module):
    def __init__(self, on_call: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.on_call, self.calls = on_call, 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if self.calls == self.on_call:
            raise KeyboardInterrupt  # not an Exception: nothing may catch it on the way out
        return h.tanh()


@pytest.mark.parametrize("transform", ["backward", "grad"])
@pytest.mark.parametrize("on_call", [1, 2], ids=["forward", "recomputation"])
def test_a_module_that_raises_is_left_with_its_own_parameters_and_works_after(transform, on_call):
    module = _RaisesOnCall(on_call)
    params = dict(module.named_parameters())
    step = remat(module)
    before = _global_state()
    with pytest.raises(KeyboardInterrupt):
        if transform == "backward":
            step(X).sum().backward()
        else:
            tf.grad(lambda p: tf.functional_call(step, p, (X,)).sum())(params)
    after = _global_state()
    assert before[0] == after[0] and before[2:] == after[2:]
    assert dict(module.named_parameters()) == params and all(type(p) is torch.nn.Parameter for p in params.values())
    module.on_call = 0
    got = tf.grad(lambda p: tf.functional_call(step, p, (X,)).sum())(params)
    assert_close(got, tf.grad(lambda p: tf.functional_call(module, p, (X,)).sum())(params))


def _interrupted_in_the_first_put_back(module: torch.nn.Module, at: int | None) -> list:
    """Run ``remat(module)`` forward and backward with a KeyboardInterrupt raised where the interpreter
    would raise a pending one (a Ctrl-C, a signal handler's exception): before the ``at``-th line that
    the first run's putting back of the module's tensors executes (``reparametrized.__exit__`` and the
    methods of ``_capture`` it calls). ``at=None``: no interruption. Returns the lines it executed."""
    import sys

    exit_code, lines, state = _capture.reparametrized.__exit__.__code__, [], {"inside": False, "done": False}

    def tracer(frame, event, arg):
        if state["done"]:
            return None
        if frame.f_code is exit_code:
            state["inside"] = True
        elif not state["inside"] or frame.f_code.co_filename != exit_code.co_filename:
            return None

        def local(frame, event, arg):
            if state["done"]:
                return None
            if event == "line":
                if len(lines) == at:
                    state["done"] = True
                    raise KeyboardInterrupt
                lines.append((frame.f_code.co_name, frame.f_lineno))
            elif event == "return" and frame.f_code is exit_code:
                state["done"] = True
            return local

        return local

    x = torch.randn(5, 4, dtype=D)
    previous = sys.gettrace()  # (a coverage tool's or a debugger's, put back after)
    sys.settrace(tracer)
    try:
        remat(module)(x).square().sum().backward()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(previous)
    return lines


def test_an_interruption_while_a_run_puts_the_parameters_back_leaves_the_module_its_own():
    """An asynchronous exception (Ctrl-C in a notebook, a preemption handler raising) lands wherever the
    interpreter is. Where it lands while a run puts the module's parameters back, the module must still
    end with its own: with a run's stand-ins left in their places, every later step would train the
    stand-ins and the optimizer's parameters would silently get no gradient. (A ``try`` line, before
    anything is protected, and a ``with`` statement's own line, where it takes or leaves a lock, are the
    interpreter's own windows.)"""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh(), torch.nn.Linear(4, 4, dtype=D))

    x = torch.randn(5, 4, dtype=D)
    plain = model()
    plain(x).square().sum().backward()
    import linecache

    lines = _interrupted_in_the_first_put_back(model(), None)
    assert len(lines) > 10
    for at, (_, number) in enumerate(lines):
        statement = linecache.getline(_capture.__file__, number).strip()
        if statement.startswith(("try:", "with ", "def ")):
            continue  # (the interpreter's own windows: before a try, around a with's lock)
        module = model()
        params = dict(module.named_parameters())
        _interrupted_in_the_first_put_back(module, at)
        assert all(p is params[n] for n, p in module.named_parameters()), f"interrupted at {lines[at]}"
        assert not _capture._runs and not _capture._runs_by_thread, f"interrupted at {lines[at]}"
        assert not _capture._runs_lock._is_owned(), f"interrupted at {lines[at]}"  # type: ignore[attr-defined]
        module.zero_grad(set_to_none=True)
        remat(module)(x).square().sum().backward()
        assert_close({n: p.grad for n, p in params.items()}, {n: p.grad for n, p in plain.named_parameters()})


class _ShardMissing(Exception):
    def __init__(self, shard: int, detail: str) -> None:
        super().__init__(f"shard {shard}: {detail}")
        self.shard = shard


_RAISED_IN_A_RECOMPUTATION = {
    "OSError": (lambda: FileNotFoundError(2, "No such file", "/data/shard3"), ("errno", "strerror", "filename")),
    "UnicodeDecodeError": (
        lambda: UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        ("encoding", "object", "start", "end", "reason"),
    ),
    "a class of the user's": (lambda: _ShardMissing(3, "gone"), ("shard",)),
    "StopIteration": (lambda: StopIteration(7), ("value",)),
}


@pytest.mark.parametrize("transform", ["backward", "grad"])
@pytest.mark.parametrize("raised", _RAISED_IN_A_RECOMPUTATION.values(), ids=_RAISED_IN_A_RECOMPUTATION.keys())
def test_an_error_of_the_recomputation_reads_as_the_same_error_without_remat(raised, transform):
    """The CheckpointError a recomputation's exception becomes is of that exception's type (an
    ``except`` for it still catches it) and carries its attributes, as the same exception raised by
    the function without remat does; its message is remat's, with the original's in it."""
    make, attributes = raised

    def caught(use_remat: bool) -> BaseException:
        calls = []

        def f(x):
            calls.append(1)
            if len(calls) == (2 if use_remat else 1):  # the recomputation; without remat, the only call
                raise make()
            return x.sin()

        g = remat(f) if use_remat else f
        with pytest.raises(type(make())) as info:
            if transform == "backward":
                g(X.clone().requires_grad_()).sum().backward()
            else:
                tf.grad(lambda x: g(x).sum())(X)
        return info.value

    original, got = caught(False), caught(True)
    assert isinstance(got, CheckpointError) and type(got.__cause__) is type(original)
    for name in attributes:
        assert getattr(got, name) == getattr(original, name), name
    assert str(got).startswith("remat(f): the recomputation") and str(original) in str(got)


def test_recomputation_computing_something_else_with_same_shapes_raises():
    calls = []

    def f(x):
        calls.append(1)
        return x.sin().exp().sin() if len(calls) == 1 else x.sin().exp()

    x = X.clone().requires_grad_()
    y = remat(f)(x)
    with pytest.raises(CheckpointError, match="output tensor 0 has other values"):
        y.sum().backward()


class _SwitchesOnItsFirstCall(torch.nn.Module):
    """HF BigBird's switch of attention type, with dropout: the first call builds a new block (nn.init
    draws from the generator), so a recomputation, which finds it built, draws other masks."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.block = None

    def forward(self, x):
        if self.block is None:
            self.block = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh())
            self.block[0] = self.lin
        return F.dropout(self.block(x), 0.5)


def test_a_module_that_rebuilds_part_of_itself_on_its_first_call_raises_saying_what_to_do():
    torch.manual_seed(0)
    net = _SwitchesOnItsFirstCall()
    with pytest.raises(CheckpointError, match=r"rebuilds part of itself on its first call.*torch.no_grad\(\) first"):
        remat(net)(X).sum().backward()
    nets = []
    for _ in range(2):
        torch.manual_seed(0)
        nets.append(_SwitchesOnItsFirstCall())
    net, plain = nets
    with torch.no_grad():  # (as the error says: once, before training)
        remat(net)(X), plain(X)
    torch.manual_seed(1)
    remat(net)(X).sum().backward()
    torch.manual_seed(1)
    plain(X).sum().backward()
    assert_close(net.lin.weight.grad, plain.lin.weight.grad)


def _another_value_on_each_call(allocating):
    """A function that runs ``allocating`` on its input, then returns another value on each call."""
    calls = []

    def f(x):
        calls.append(1)
        allocating(x)
        return x.sin() * len(calls)

    return f


#: Memory a function allocates uninitialized and writes whole before reading any of it.
_SETS_WHAT_IT_ALLOCATES = {
    "uniform_": lambda x: torch.empty_like(x).uniform_(),
    "copy_": lambda x: torch.empty(x.shape, dtype=x.dtype).copy_(x.cos()),
    "out=": lambda x: torch.add(x.detach(), 1, out=torch.empty_like(x)),
    "nn.init": lambda x: torch.nn.init.normal_(torch.empty_like(x)),
    "a module built inside": lambda x: torch.nn.Linear(x.shape[-1], 2, dtype=x.dtype),  # (HF BigBird)
}


@pytest.mark.parametrize("how", list(_SETS_WHAT_IT_ALLOCATES))
def test_memory_allocated_uninitialized_and_written_whole_leaves_the_value_check_on(how):
    """Only a read of memory before it is written whole may carry garbage into the values: a function
    that writes what it allocates (a module built inside the call) is still checked."""
    x = X.clone().requires_grad_()
    y = remat(_another_value_on_each_call(_SETS_WHAT_IT_ALLOCATES[how]))(x)
    with pytest.raises(CheckpointError, match="output tensor 0 has other values"):
        y.sum().backward()


def _add_to_itself(x):
    t = torch.empty_like(x)
    return torch.add(t, 1, out=t)  # reads t, then writes it whole


#: Memory a function allocates uninitialized and reads (maybe in part) before writing it whole.
_READS_WHAT_IT_ALLOCATES = {
    "read": lambda x: torch.empty_like(x).sum(),
    "out= also an input": _add_to_itself,
    "written in part": lambda x: torch.empty_like(x)[0].fill_(1),
    # (an alias torch makes where no torch function sees it: the same memory, read)
    "through a Parameter": lambda x: torch.nn.Parameter(torch.empty_like(x), requires_grad=False).sum(),
    # (other allocations of uninitialized memory)
    "x.new(n)": lambda x: x.detach().new(x.numel()).sum(),
    "resize_": lambda x: torch.zeros(1, dtype=x.dtype).resize_(x.numel()).sum(),
    "empty_permuted": lambda x: torch.empty_permuted(x.shape, (1, 0), dtype=x.dtype).sum(),
}


@pytest.mark.parametrize("how", list(_READS_WHAT_IT_ALLOCATES))
def test_memory_read_before_it_is_written_whole_turns_the_value_check_off(how):
    """A run that may have computed from garbage is not compared by value: what differs may be the
    garbage (an ``out=`` tensor that is also an input is read before it is written)."""
    x = X.clone().requires_grad_()
    remat(_another_value_on_each_call(_READS_WHAT_IT_ALLOCATES[how]))(x).sum().backward()  # (no 'did not reproduce')


def test_an_uninitialized_tensor_without_elements_leaves_the_value_check_on():
    """``torch.empty(0)`` (a placeholder kept through the run) holds no garbage to read."""
    calls = []

    def f(x):
        calls.append(1)
        placeholder = torch.empty(0, dtype=x.dtype)
        y = x.sin() * len(calls)  # another value on each call
        return torch.cat([placeholder, y])

    x = X[0].clone().requires_grad_()
    y = remat(f)(x)
    with pytest.raises(CheckpointError, match="output tensor 0 has other values"):
        y.sum().backward()


@pytest.mark.parametrize("numpy", [True, False], ids=["through NumPy", "torch without NumPy"])
@pytest.mark.parametrize("defer", [False, True], ids=["read at once", "deferred, as on an accelerator"])
@pytest.mark.parametrize(
    "change",
    [
        lambda y, calls: torch.roll(y, shifts=calls, dims=0),
        lambda y, calls: F.layer_norm(y + calls * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype), y.shape[-1:]),
    ],
    ids=["rolled by a counter", "LayerNorm of a counter-dependent input"],
)
def test_recomputation_with_the_same_sum_and_norm_but_other_values_raises(monkeypatch, change, defer, numpy):
    """Values that moved (a roll) or changed keeping their sum and norm (a LayerNorm's rows keep
    sum 0 and norm sqrt(n) whatever its input): the digest's position-weighted sum sees them
    (a small output's on the CPU through NumPy, or through torch where torch has no NumPy)."""
    from funckpt import _errors

    monkeypatch.setattr(_errors, "DEFER_ON_CPU", defer)
    if not numpy:
        monkeypatch.setattr(_errors, "_NUMPY_WEIGHTS", {})
    calls = []
    w = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def f(x):
        calls.append(1)
        return change(torch.tanh(x @ w), len(calls))

    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = remat(f)(x)
    with pytest.raises(CheckpointError, match="position-weighted sum"):
        y.sum().backward()
    calls.clear()
    remat(lambda x: change(torch.tanh(x @ w), 1))(x).sum().backward()  # the same values each time: no alarm


def test_checkpoint_sequential_with_a_misplaced_tensor_raises_type_error():
    import funckpt

    with pytest.raises(TypeError, match="use_reentrant"):
        funckpt.checkpoint_sequential(torch.nn.Sequential(torch.nn.Tanh()), 1, X, X)


def test_non_differentiable_input_updated_then_read_recomputes_from_its_original_value():
    def f(x, buf):
        buf.add_(1.0)
        return (x * buf).sin().sum()

    x = torch.tensor([0.1, 0.2, 0.3], dtype=D)
    b = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    expected = tf.grad(f)(x, b.clone())
    assert_close(tf.grad(remat(f))(x, b.clone()), expected)
    xl = x.clone().requires_grad_()
    buf = b.clone()
    remat(f)(xl, buf).backward()
    assert_close(xl.grad, expected)
    assert_close(buf, b + 1)  # updated once


def test_in_place_update_of_a_jvp_input_raises():
    def f(x):
        x.mul_(2)
        return x.sin()

    with pytest.raises(CheckpointError, match="differentiable inputs in place"):
        tf.jvp(remat(f), (X.clone(),), (torch.ones_like(X),))


def test_output_that_is_a_view_of_an_input_is_a_real_view_of_it():
    """As without remat: an in-place update through the view reaches the input, and autograd knows."""

    def program(f):
        x = torch.tensor([1.0, 2.0, 3.0], dtype=D, requires_grad=True)
        a = x * 2
        y = f(a)
        y.mul_(10)
        (a.square().sum() + y.sum()).backward()
        return a.detach(), x.grad

    assert_close(program(remat(lambda a: a[:2])), program(lambda a: a[:2]))


@pytest.mark.parametrize("how", ["backward", "torch.func.grad"])
def test_input_changed_by_an_in_place_view_then_written_is_recomputed_from_before_both(how):
    """``unsqueeze_`` and ``resize_`` change an input's metadata only, but the snapshot is taken
    before them: the recomputation starts from the input's shape and values at the call (not
    the reshaped, or resized and never written, tensor a later write would snapshot), and the
    caller's tensor is changed once, as without remat. (Before, the first raised a false
    "cannot undo" CheckpointError, and an observer's empty buffer resized then filled made the
    recomputation compute something else.)"""

    def f(w, x, buf):
        x.unsqueeze_(0)
        if buf.numel() == 0:  # as torch.ao observers do with their min_val / max_val
            buf.resize_(4)
            buf.copy_(x[0, 0])
        else:
            buf.mul_(0.5)
        return ((x @ w) * buf).sin().sum()

    w = torch.randn(4, 4, dtype=D)

    def program(g):
        x, buf = X.clone(), torch.empty(0, dtype=D)
        if how == "backward":
            ww = w.clone().requires_grad_()
            g(ww, x, buf).backward()
            gradient = ww.grad
        else:
            gradient = tf.grad(g)(w, x, buf)
        return gradient, x, buf

    assert_close(program(remat(f)), program(f))


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda c: c.t().mul_(2), id="transpose"),
        pytest.param(lambda c: c[:1].add_(1), id="slice"),
        pytest.param(lambda c: c[0, 0].add_(1), id="element"),
        pytest.param(lambda c: c.diagonal().add_(1), id="diagonal"),
        pytest.param(lambda c: c.view(-1).unbind()[1].add_(1), id="unbind"),
    ],
)
def test_input_written_through_a_view_is_snapshotted_whole(write):
    def f(x, c):
        out = x * (c * 1)  # reads c before the write
        write(c)
        return (out + x.cos() * c).sum()

    x = torch.ones(2, 2, dtype=D, requires_grad=True)
    results = []
    for fn in (f, remat(f)):
        c = torch.arange(1.0, 5.0, dtype=D).reshape(2, 2)
        results.append((torch.autograd.grad(fn(x, c), x), c))
    assert_close(results[1], results[0])


#: Every way a function writes a tensor it is handed: torch's built-ins and tensor methods (known
#: by their operator schemas), Python's in-place syntax, out= arguments, operator overloads,
#: and functions written in Python that write what they are handed (batch norm's statistics,
#: an embedding renormalised by max_norm, inplace=True, torch.nn.init).
NON_DIFFERENTIABLE_WRITES = {
    "method": lambda c: c.add_(1),
    "setitem": lambda c: c.__setitem__(0, 7.0),
    "iadd": lambda c: c.__iadd__(1),
    "out=": lambda c: torch.add(c.clone(), 1, out=c),
    "out= tuple": lambda c: torch.sort(c.clone(), out=(c, torch.empty(4, dtype=torch.long))),
    # (torch.sub called first without keywords: the watch then knows it writes nothing that way)
    "out= of a function called before without it": lambda c: torch.sub(torch.sub(c, 1), 1, out=c),
    "aten overload": lambda c: torch.ops.aten.mul_.Tensor(c, 3),
    "aten packet": lambda c: torch.ops.aten.mul_(c, 3),
    "foreach": lambda c: torch._foreach_mul_([c], 2.0),
    "index_copy_": lambda c: c.index_copy_(0, torch.tensor([1]), torch.tensor([9.0], dtype=D)),
    "through .data": lambda c: c.data.mul_(2),
    "through a view": lambda c: c[1:3].mul_(2),
    "inplace=True": lambda c: torch.nn.functional.hardtanh(c, -0.5, 0.5, inplace=True),
    "torch.nn.init": lambda c: torch.nn.init.constant_(c, 0.25),
    "batch norm statistics": lambda c: torch.nn.functional.batch_norm(
        torch.arange(8.0, dtype=D).reshape(2, 4), c, torch.ones(4, dtype=D), training=True
    ),
    "embedding max_norm": lambda c: torch.nn.functional.embedding(torch.tensor([0]), c.view(1, 4), max_norm=0.5),
    "batch norm statistics by keyword": lambda c: torch.nn.functional.batch_norm(
        torch.arange(8.0, dtype=D).reshape(2, 4), running_mean=c, running_var=torch.ones(4, dtype=D), training=True
    ),
    "instance norm statistics": lambda c: torch.nn.functional.instance_norm(
        torch.arange(16.0, dtype=D).reshape(2, 4, 2), running_mean=c, running_var=torch.ones(4, dtype=D)
    ),
    "embedding max_norm by keyword": lambda c: torch.nn.functional.embedding(
        input=torch.tensor([0]), weight=c.view(1, 4), max_norm=0.5
    ),
    "relu inplace=True": lambda c: torch.nn.functional.relu(c, inplace=True),
    "threshold inplace=True by keyword": lambda c: torch.nn.functional.threshold(
        input=c, threshold=0.75, value=-2.0, inplace=True
    ),
    "normalize out=": lambda c: torch.nn.functional.normalize(c.clone(), dim=0, out=c),
    "resize_": lambda c: c.resize_(2).fill_(3.0),
    "**=": lambda c: c.__ipow__(2),
    "data setter": lambda c: setattr(c, "data", torch.full((4,), 2.0, dtype=D)),
    "by keyword": lambda c: torch.index_put_(input=c, indices=(torch.tensor([0]),), values=torch.tensor(3.0, dtype=D)),
    "by keyword through .data": lambda c: torch.relu_(input=c.data),
}


@pytest.mark.parametrize("how", ["backward", "torch.func.grad"])
@pytest.mark.parametrize("write", NON_DIFFERENTIABLE_WRITES.values(), ids=NON_DIFFERENTIABLE_WRITES.keys())
def test_every_kind_of_write_to_a_non_differentiable_input_happens_once_and_is_undone_for_the_recomputation(
    write, how
):
    if how == "torch.func.grad" and write is NON_DIFFERENTIABLE_WRITES["data setter"]:
        pytest.skip("functorch refuses a .data write inside its transforms, with or without remat")

    def f(x, c):
        out = x * (c * 1).sum()  # reads c before the write
        write(c)
        return (out + x.cos() * c.sum()).sum()

    def program(fn):
        c = torch.tensor([0.5, -1.0, 2.0, 1.0], dtype=D)
        x = torch.linspace(0.1, 1, 4, dtype=D)
        if how == "backward":
            x.requires_grad_()
            gradient = torch.autograd.grad(fn(x, c), x)
        else:
            gradient = tf.grad(fn)(x, c)
        return gradient, c

    assert_close(program(remat(f)), program(f))


def test_a_non_differentiable_input_is_watched_without_a_dispatch_mode():
    """The write watch asks each torch function what it writes: the function's operators run
    without a Python dispatch mode (which would cost a Python call per operator)."""
    modes = []

    def f(x, mask):
        modes.append(torch._C._len_torch_dispatch_stack())
        return (x * mask).sin().sum()

    x = torch.ones(4, dtype=D, requires_grad=True)
    remat(f)(x, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)).backward()
    assert modes == [0, 0]


def test_torch_tensors_own_python_functions_are_watched_without_a_dispatch_mode():
    """x ** 2, 1 - x, len(x), x.split and torch.einsum are written in Python, as torch.Tensor's
    methods or torch.functional's, and named as the built-ins are: known by name too."""
    modes = []

    class Recording(torch.Tensor):  # notes the dispatch modes around each torch function it reaches
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            modes.append(torch._C._len_torch_dispatch_stack())
            return super().__torch_function__(func, types, args, kwargs or {})

    def f(x, mask):
        m = (1 - mask) ** 2 / 2
        a, b = m.split(2)
        return torch.einsum("i,i->", x, mask) + len(mask) * (x[:2] * a).sum() + b.sum()

    x = torch.ones(4, dtype=D, requires_grad=True)
    remat(f)(x, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D).as_subclass(Recording)).backward()
    assert modes and set(modes) == {0}


@pytest.mark.parametrize("how", ["backward", "torch.func.grad"])
def test_a_write_given_by_keyword_through_data_is_undone_for_the_recomputation(how):
    """No version counter tells of a write through .data: a recomputation from the written value
    went unnoticed where the output's value does not show it (a permutation, summed)."""

    def f(x, c):
        out = (x * c).sum()  # its gradient is c: the recomputation must read it unpermuted
        torch.index_put_(input=c.data, indices=(torch.arange(4),), values=c.flip(0))
        return out

    def program(fn):
        c = torch.tensor([0.5, -1.0, 2.0, 1.0], dtype=D)
        x = torch.ones(4, dtype=D)
        if how == "backward":
            x.requires_grad_()
            return torch.autograd.grad(fn(x, c), x), c
        return tf.grad(fn)(x, c), c

    assert_close(program(remat(f)), program(f))


#: Writes through the memory a tensor hands out: no torch function or operator runs, and the
#: tensor's version counter does not move.
WRITES_THROUGH_SHARED_MEMORY = {
    "untyped storage": lambda c, v: c.untyped_storage().copy_(v.untyped_storage()),
    "typed storage": lambda c, v: c.storage().copy_(v.storage()),
    "numpy": lambda c, v: c.numpy().__setitem__(slice(None), v.numpy()),
}


@pytest.mark.parametrize("write", WRITES_THROUGH_SHARED_MEMORY.values(), ids=WRITES_THROUGH_SHARED_MEMORY.keys())
def test_a_write_through_an_inputs_storage_is_undone_for_the_recomputation(write):
    def f(x, c):
        out = (x * c).sum()  # its gradient is c: the recomputation must read it unpermuted
        write(c, c.flip(0))
        return out

    def program(fn):
        c = torch.tensor([0.5, -1.0, 2.0, 1.0], dtype=D)
        x = torch.ones(4, dtype=D, requires_grad=True)
        return torch.autograd.grad(fn(x, c), x), c

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        assert_close(program(remat(f)), program(f))


def test_a_nested_call_that_only_reads_a_non_differentiable_input_does_not_copy_it(monkeypatch):
    """remat's own work for the nested call reads the input's storage: that is no write of the
    function's (a copy of the input per nested call, in the forward run of the enclosing one)."""
    from funckpt import _call

    copied = []

    def clone_together(tensors):
        copied.extend(tuple(t.shape) for t in tensors)
        return real(tensors)

    real = _call.clone_together
    monkeypatch.setattr(_call, "clone_together", clone_together)

    def outer(x, mask):
        return (remat(torch.mul)(x.sin(), mask) * mask).sum()

    x = torch.ones(4, dtype=D, requires_grad=True)
    remat(outer)(x, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)).backward()
    assert copied == []


def test_torch_functions_written_in_python_run_without_a_dispatch_mode(monkeypatch):
    """F.layer_norm, F.dropout, F.silu, F.softmax, F.pad, torch.split ... are written in Python: the
    watch knows from their parameters what they write (nothing, unless inplace=True, a batch
    norm in training mode ...), so their operators run without the watch as a Python dispatch
    mode, as a built-in's do. (Under it, each F.layer_norm of a Hugging Face layer cost tens of
    microseconds.)"""
    from funckpt import _saving

    watched = []
    original = _saving.WriteWatch.__torch_dispatch__
    entered = _saving.WriteWatch.__enter__

    def spy(self, func, types, args=(), kwargs=None):
        watched.append(func)
        return original(self, func, types, args, kwargs)

    def spy_enter(self):
        watched.append("entered")
        return entered(self)

    monkeypatch.setattr(_saving.WriteWatch, "__torch_dispatch__", spy)
    monkeypatch.setattr(_saving.WriteWatch, "__enter__", spy_enter)
    running_mean, running_var = torch.zeros(2, dtype=D), torch.ones(2, dtype=D)

    def f(x, mask):
        torch._assert(mask.shape[0] == 4, "four")  # (timm's blocks check their shapes so)
        h = F.layer_norm(x * mask, (4,))
        h = F.silu(F.dropout(h, 0.0, training=True))
        a, b = torch.split(F.pad(F.softmax(h, -1), (0, 1)), [2, 3], dim=-1)
        n = F.batch_norm(x.T, running_mean, running_var, training=False)
        return a.sum() + b.sum() + n.sum() + (1 - x).sum()

    x = torch.ones(2, 4, dtype=D, requires_grad=True)
    remat(f)(x, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)).backward()
    assert watched == []
    remat(lambda x, mask: torch.nn.init.constant_(mask, 2.0).sum() * x.sum())(x, torch.ones(3, dtype=D)).backward()
    assert watched  # (a Python function the watch does not know still runs under it)


def test_a_write_no_torch_function_announces_raises_instead_of_recomputing_from_it():
    def f(x, c):
        out = x * c.sum()
        with torch._C.DisableTorchFunction():  # hides the write from torch-function modes
            c.add_(1)
        return out.sum()

    x = torch.ones(4, dtype=D, requires_grad=True)
    with pytest.raises(CheckpointError, match="announced itself to neither"):
        remat(f)(x, torch.ones(4, dtype=D))


@pytest.mark.parametrize("write_whole", [True, False])
def test_inputs_that_share_a_storage_still_share_it_in_the_recomputation(write_whole):
    def f(w, a, b):  # b is a view of a: writing one changes the other
        (a if write_whole else b).mul_(2.0)
        return ((a[1:] if not write_whole else b) * w).sum()

    results = []
    for fn in (f, remat(f)):
        w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D, requires_grad=True)
        a = torch.ones(5, dtype=D)
        results.append(torch.autograd.grad(fn(w, a, a[1:]), w))
        a2 = torch.ones(5, dtype=D)
        results.append(tf.grad(fn)(w.detach(), a2, a2[1:]))
    assert_close(results[2:], results[:2])


@pytest.mark.parametrize("transform", ["backward", "vjp"])
def test_input_modified_after_the_call_raises_a_checkpoint_error(transform):
    """torch's own version-counter error would name no remat call and say nothing of what to do."""
    x = X.clone().requires_grad_()
    a = x * 1
    if transform == "backward":
        y = remat(torch.sin)(a)
        a.mul_(2)
        with pytest.raises(CheckpointError, match="modified in place between the forward and the backward"):
            y.sum().backward()
    else:
        def f(x):
            a = x * 1
            y = remat(torch.sin)(a)
            a.mul_(2)
            return y

        with pytest.raises(CheckpointError, match="modified in place between the forward and the backward"):
            _, vjp_fn = tf.vjp(f, a.detach())
            vjp_fn(torch.ones_like(X))


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad", "jacrev"])
def test_deferred_value_check_raises_at_the_end_of_the_backward(monkeypatch, transform):
    """On an accelerator the value comparison waits for the end of the backward pass (one host
    sync); exercised here on the CPU. It still raises, and leaves nothing pending."""
    from funckpt import _errors

    monkeypatch.setattr(_errors, "DEFER_ON_CPU", True)
    calls = []

    def f(x):
        calls.append(1)
        return x.sin() if len(calls) % 2 == 1 else x.cos()

    def run(g):
        if transform == "backward":
            x = X.clone().requires_grad_()
            g(x).sum().backward()
        elif transform == "grad":
            tf.grad(lambda x: g(x).sum())(X)
        elif transform == "vmap_grad":
            tf.vmap(tf.grad(lambda x: g(x).sum()))(X)
        else:
            tf.jacrev(g)(X)

    with pytest.raises(CheckpointError, match="has other values"):
        run(remat(f))
    assert _errors._deferred == {}
    run(remat(torch.sin))  # a deterministic function: no alarm
    assert _errors._deferred == {}


@pytest.mark.parametrize("transform", ["backward", "grad"])
def test_a_backward_that_raises_after_deferring_a_check_leaves_nothing_pending(monkeypatch, transform):
    """The engine drops a failed backward's callbacks: the checks it deferred go with them
    (they held digests and traces for good, one entry per failed backward), and the next
    backward still checks."""
    from funckpt import _errors

    monkeypatch.setattr(_errors, "DEFER_ON_CPU", True)

    def fail(grad):
        raise ValueError("hook")

    def loss(x):
        h = x * 1
        h.register_hook(fail)  # runs after the remat'd call's backward deferred its check
        return remat(torch.sin)(h).sum()

    for _ in range(3):
        with pytest.raises(ValueError, match="hook"):
            if transform == "backward":
                loss(X.clone().requires_grad_()).backward()
            else:
                tf.grad(loss)(X)
    assert dict(_errors._deferred) == {}
    calls = []

    def f(x):
        calls.append(1)
        return x.sin() if len(calls) % 2 == 1 else x.cos()

    with pytest.raises(CheckpointError, match="has other values"):
        remat(f)(X.clone().requires_grad_()).sum().backward()
    assert dict(_errors._deferred) == {}


@pytest.mark.parametrize("changed", [None, 0, 1, 2])
def test_deferred_value_check_of_outputs_of_several_dtypes(monkeypatch, changed):
    """The deferred comparison reads every pending digest of a device at once, whatever their
    dtypes; it names the output that changed, and raises nothing where none did."""
    from funckpt import _errors

    monkeypatch.setattr(_errors, "DEFER_ON_CPU", True)
    calls = []

    def f(x):
        calls.append(1)
        outs = [x.sin(), x.cos().float(), (x * 3).to(torch.bfloat16)]
        if changed is not None and len(calls) % 2 == 0:
            outs[changed] = outs[changed] * 2
        return tuple(outs)

    def loss(g, x):
        return sum(o.double().sum() for o in g(x))

    x = X.clone().requires_grad_()
    if changed is None:
        loss(remat(f), x).backward()
        x_ref = X.clone().requires_grad_()
        loss(f, x_ref).backward()
        assert_close(x.grad, x_ref.grad)
    else:
        with pytest.raises(CheckpointError, match=f"output tensor {changed} has other values"):
            loss(remat(f), x).backward()
    assert _errors._deferred == {}


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_check_sees_a_change_in_values_whose_squares_overflow_float32(monkeypatch, dtype, defer):
    """Finite values beyond about 1e19: their sum of squares overflows float32, so a digest
    accumulated there read inf for both runs and let any change through (std_mean did not)."""
    from funckpt import _errors

    monkeypatch.setattr(_errors, "DEFER_ON_CPU", defer)
    calls = []

    def f(x):
        calls.append(1)
        return x * (1e20 if len(calls) % 2 == 1 else 2e20)

    x = X.to(dtype).requires_grad_()
    with pytest.raises(CheckpointError, match="has other values"):
        remat(f)(x).float().sum().backward()
    assert _errors._deferred == {}

    def g(x):
        return x * 1e20

    x = X.to(dtype).requires_grad_()
    remat(g)(x).float().sum().backward()  # a deterministic function: no alarm
    x_ref = X.to(dtype).requires_grad_()
    g(x_ref).float().sum().backward()
    assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("scale", [1e-160, 1e-20, 1e150, 1e18], ids=["tiny f64", "tiny f32", "huge f64", "huge f32"])
@pytest.mark.parametrize("transform", ["backward", "grad", "jacrev", "vmap"])
@pytest.mark.parametrize("scalar", [True, False], ids=["0-d", "2-d"])
def test_values_at_the_ends_of_their_dtypes_range_raise_no_false_alarm(scale, transform, scalar):
    """Values whose squares leave the normal range (subnormal or overflowing): the digest of one
    run, taken on the plain tensor, and of the other, taken under a transform (a scalar's under
    jacrev), still agree."""
    dtype = torch.float64 if scale in (1e-160, 1e150) else torch.float32
    x = ((X[0, 0] if scalar else X) * scale).to(dtype)

    def f(x):
        return (x * 1.5).sin() if scale < 1 else x * 1.5

    def run(g):
        if transform == "backward":
            x_ = x.clone().requires_grad_()
            g(x_).sum().backward()
            return x_.grad
        if transform == "grad":
            return tf.grad(lambda x: g(x).sum())(x)
        if transform == "jacrev":
            return tf.jacrev(g)(x)
        return tf.vmap(tf.grad(lambda x: g(x).sum()))(x.unsqueeze(0).repeat(2, *[1] * x.dim()))

    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e20), (torch.float64, 1e160)], ids=["f32", "f64"])
def test_values_whose_squares_overflow_give_the_caller_no_warning(dtype, scale):
    """The value digest of such an output (taken through NumPy where torch has it) warns nothing in
    the caller's code: a suite turning warnings into errors runs the function as without remat."""

    def f(x):
        return x * 1.5

    def run(g):
        x = (X * scale).to(dtype).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g(x).sum().backward()
        return x.grad

    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("scalar", [True, False], ids=["0-d", "1 element"])
def test_output_that_is_a_lazy_negative_view_is_checked_as_without_numpy(scalar):
    """``z.conj().imag`` of one complex value is a contiguous float tensor with the negative bit
    set, whose memory NumPy refuses: its digest is taken by torch, and the call runs as without remat."""

    def f(x):
        z = torch.complex(x[0, :1], x[1, :1] * 2)
        return (z[0] if scalar else z).conj().imag, x.sin()

    def run(g):
        x = X.float().requires_grad_()
        a, b = g(x)
        (a * 3 + b.sum()).sum().backward()
        return a.detach(), x.grad

    assert_close(run(remat(f)), run(f))


OTHER_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.bool]


def _cast(dtype):
    """``x`` (float) converted to ``dtype``, its sign for a boolean, making nothing else."""

    def f(x):
        return x > 0 if dtype is torch.bool else (x * 4).to(dtype) if dtype is torch.int8 else x.to(dtype)

    return f


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("dtype", OTHER_DTYPES)
def test_outputs_of_other_dtypes_are_checked_and_differentiated_as_without_remat(monkeypatch, dtype, defer):
    """16-bit, 8-bit float, integer and boolean outputs (beside a float64 one, so that the
    call is recomputed): the digest converts them (8-bit floats have no reductions of their
    own), the gradient is the plain function's, and a recomputation that computes other
    values for them is refused."""
    from funckpt import _errors

    monkeypatch.setattr(_errors, "DEFER_ON_CPU", defer)
    cast = _cast(dtype)
    # Mostly positive values: their sign flipped moves every digest beyond the 8-bit tolerance.
    x0 = torch.linspace(-1, 2, 12, dtype=D).reshape(3, 4)

    def f(x, sign=1):
        return x.sin(), cast(sign * x)

    def loss(fn, x):
        a, b = fn(x)
        return a.sum() + (b.to(D) * x).square().sum()

    x = x0.clone().requires_grad_()
    loss(remat(f), x).backward()
    x_ref = x0.clone().requires_grad_()
    loss(f, x_ref).backward()
    assert_close(x.grad, x_ref.grad)
    assert_close(tf.grad(lambda x: loss(remat(f), x))(x0), x_ref.grad)

    calls = []

    def drifting(x):
        calls.append(1)
        return f(x, 1 if len(calls) % 2 == 1 else -1)

    with pytest.raises(CheckpointError, match="output tensor 1 has other values"):
        loss(remat(drifting), x0.clone().requires_grad_()).backward()
    assert _errors._deferred == {}


@pytest.mark.parametrize("dtype", OTHER_DTYPES)
def test_the_digest_of_a_large_output_of_another_dtype_costs_no_copy_of_it(dtype):
    """Converting an output for its digest (a 16-bit one to float32, a boolean to float64) goes
    piece by piece: the forward pass of a remat'd cast peaks near where the plain cast does (a
    piece above it), not at the output plus a converted copy of it, two to eight times its size."""
    from benchmarks._common import peak_bytes

    x = torch.randn(1 << 23, requires_grad=True)
    f = _cast(dtype)
    plain = peak_bytes(lambda: f(x))
    rematted = peak_bytes(lambda: remat(f)(x))
    assert rematted - plain <= plain / 4, (rematted, plain)


def test_an_input_modified_before_the_backward_is_named():
    """The error names the parameter the update hit (a frozen weight an optimizer or an adapter merge changed)."""
    import funckpt

    lin = torch.nn.Linear(3, 3, dtype=torch.float64)
    lin.weight.requires_grad_(False)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    loss = funckpt.remat(lin)(x).sum()
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(funckpt.CheckpointError, match=r"Linear's 'weight' \(shape \(3, 3\)\) was modified in place"):
        loss.backward()


@pytest.mark.parametrize("arity", ["arguments", "outputs"])
def test_a_nondeterministic_function_around_a_nested_remat_of_a_new_arity_still_raises(arity):
    """Handling the inner call's tree of plain tensors, of a size remat meets here for the first
    time (23 of them: no other test uses it), must not count as the outer function's own work: an
    uninitialized allocation by remat itself turned the outer run's value check off."""
    n = 23
    if arity == "arguments":
        inner = remat(lambda *xs: torch.stack(xs).sin().sum(0))
        call_inner = lambda x: inner(*[x * (i + 1) for i in range(n)])  # noqa: E731
    else:
        inner = remat(lambda x: tuple(x * (i + 1) for i in range(n)))
        call_inner = lambda x: torch.stack(inner(x)).sin().sum(0)  # noqa: E731
    calls = []

    def outer(x):
        calls.append(1)
        return call_inner(x) * len(calls)  # another value on each call

    x = X.clone().requires_grad_()
    y = remat(outer)(x)
    with pytest.raises(CheckpointError, match="has other values"):
        y.sum().backward()


def test_a_recomputation_for_forward_mode_is_not_said_to_run_in_a_backward_pass():
    """Under jvp the recomputation runs in the Function's forward-mode rule: the message says so."""
    runs = []

    def f(x):
        runs.append(1)
        return x.sin() * len(runs)  # other values at each run

    with pytest.raises(CheckpointError, match="recomputation for forward-mode differentiation"):
        tf.jvp(remat(f), (torch.randn(3, dtype=torch.float64),), (torch.randn(3, dtype=torch.float64),))


def _multi_grad_hook_run(wrap, *, leaves: bool = False, nest: bool = False, second: bool = False):
    """Gradients and the hook's calls of ``f``, which registers ``register_multi_grad_hook`` on its
    inputs, under ``.backward()`` (``second``: two of them, the graph retained by the first)."""
    calls = []

    def f(w, x):
        torch.autograd.graph.register_multi_grad_hook((w, x), lambda grads: calls.append([g.clone() for g in grads]))
        return torch.tanh(x @ w)

    def g(w, x):
        return remat(f)(w, x).cos()

    w = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
    x = X.clone().requires_grad_()
    y = wrap(g if nest else f)(*((w, x) if leaves else (w * 1, x * 1)))
    y.sum().backward(retain_graph=second)
    if second:
        (2 * y).sum().backward()
    return w.grad, x.grad, calls


@pytest.mark.parametrize("case", ["non-leaves", "leaves", "nested", "two backward passes"])
def test_a_multi_grad_hook_registered_on_the_inputs_inside_is_called_once_with_their_gradients(case):
    """``register_multi_grad_hook`` on the function's inputs (what module trackers, FSDP and
    profilers register): remat's forward run has copies of them, whose nodes the hook counts; it is
    moved to the caller's tensors with their nodes in its count, and is called once per backward
    pass with the caller's tensors' whole gradients, as without remat."""
    options = dict(leaves=case == "leaves", nest=case == "nested", second=case == "two backward passes")
    expected = _multi_grad_hook_run(lambda f: f, **options)
    got = _multi_grad_hook_run(remat, **options)
    assert len(got[2]) == len(expected[2]) >= 1
    assert_close(got, expected)


def test_a_multi_grad_hook_on_an_input_and_a_tensor_computed_inside_is_refused():
    """A ``register_multi_grad_hook`` over an input and a tensor the function computed: the
    latter's gradient is computed in the recomputation's backward pass, the input's in the caller's,
    so no single call could have both. Refused, saying how to register it instead."""

    def f(w, x):
        h = x @ w
        torch.autograd.graph.register_multi_grad_hook((x, h), lambda grads: None)
        return torch.tanh(h)

    with pytest.raises(CheckpointError, match=r"remat\(f\).*register_multi_grad_hook.*(?s:Register one hook on the inputs)"):
        remat(f)(torch.randn(4, 4, dtype=D, requires_grad=True) * 1, X.clone().requires_grad_() * 1)


def test_an_error_only_forward_mode_reaches_is_not_blamed_on_changed_state():
    """A custom Function's jvp reading ``ctx.saved_tensors`` without ``save_for_forward`` fails
    only where tangents are computed: the recomputation's error says that code runs there, and
    stays an instance of the error's own type."""

    class Sin(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.sin(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])  # (not save_for_forward)

        @staticmethod
        def backward(ctx, g):
            return torch.cos(ctx.saved_tensors[0]) * g

        @staticmethod
        def jvp(ctx, t):
            (x,) = ctx.saved_tensors
            return torch.cos(x) * t

    with pytest.raises(ValueError):
        tf.jvp(Sin.apply, (X,), (torch.ones_like(X),))
    with pytest.raises(CheckpointError, match="save_for_forward") as raised:
        tf.jvp(remat(Sin.apply), (X,), (torch.ones_like(X),))
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (8, 16), (64, 64), (65, 64)])
@pytest.mark.parametrize("change", [0.0, 1e-12, 1e-7, 1e-4, 1e-1, "shape", "dtype", "permuted"])
def test_the_quick_check_of_one_output_answers_as_the_full_check(shape, dtype, change):
    """A recomputation's one small CPU output is checked at once (funckpt._errors.reproduced); where
    it says the output is reproduced, the full checks find nothing, and where the full checks
    would raise, it does not say so. (It may leave an output it cannot tell to them: the
    largest here, past the size it reads at once.)"""
    from funckpt._errors import check_same_outputs, differing_digests, digest, reproduced, tensor_meta

    torch.manual_seed(0)
    forward = torch.randn(shape, dtype=dtype)
    if change == "shape":
        again = forward.reshape(-1)[: forward.numel() - 1].clone() if forward.numel() > 1 else forward.repeat(2)
    elif change == "dtype":
        again = forward.to(torch.float64 if dtype is torch.float32 else torch.float32)
    elif change == "permuted":
        again = forward.reshape(-1).flip(0).reshape(shape).clone()
    else:
        again = forward + change * forward.abs().max()
    told = reproduced(tensor_meta(forward), digest([forward])[0], again)
    try:
        check_same_outputs("f", [tensor_meta(forward)], [again], None)
        full = not differing_digests(digest([forward]), digest([again]))
    except CheckpointError:
        full = False
    if told:
        assert full
    elif forward.numel() <= 4096:
        assert not full  # (told at once: the quick check leaves nothing it reads to the full one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [1e-40, 1e-20, 1e19, 1e-200, 1e200, float("inf"), float("nan")])
def test_a_digest_raises_no_numpy_error_whatever_numpy_is_set_to(value, dtype):
    """NumPy reads small CPU outputs for the determinism check: a caller's np.seterr(all="raise")
    (or warnings turned into errors) must not make an output of extreme values raise there."""
    np = pytest.importorskip("numpy")
    from funckpt._errors import digest

    x = torch.tensor([value, 1.0, -2.0], dtype=dtype).requires_grad_()
    before = np.seterr(all="raise")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = remat(lambda x: x * 1)(x)
            y.sum().backward()
            digest([torch.tensor([value], dtype=dtype)])
    finally:
        np.seterr(**before)
    assert_close(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("dtype,value", [(torch.float32, 1e-40), (torch.float32, 1e-42), (torch.float64, 5e-324), (torch.float64, 1e-310)])
@pytest.mark.parametrize("others", [0, 1])
def test_a_subnormal_output_value_raises_no_numpy_underflow_where_numpy_raises(dtype, value, others):
    """A subnormal value anywhere in a small CPU output (not only at the first position, whose
    weight is 1): its product with a position weight underflows in the weighted sum. Under the
    caller's np.seterr(all="raise") the digest must not raise there (a FloatingPointError from
    funckpt's own check, not the user's code), with one output or with another beside it."""
    np = pytest.importorskip("numpy")

    v = torch.tensor([1.0, value, -2.0, value], dtype=dtype)

    def f(x):
        y = x * v
        return (y, x.half()) if others else y

    x = torch.ones(4, dtype=dtype, requires_grad=True)
    before = np.seterr(all="raise")
    try:
        out = remat(f)(x)
        (out[0] if others else out).sum().backward()
    finally:
        np.seterr(**before)
    assert_close(x.grad, v)


@pytest.mark.parametrize("setting", ["raise", "warn"])
def test_a_signaling_nan_in_a_small_float32_output_makes_numpy_report_nothing(setting):
    """A float32 output holding a signaling NaN (made from its bits): the digest's NumPy cast of it
    to float64 is an invalid operation, which NumPy reports (a RuntimeWarning by its default
    settings, an error under np.seterr(all="raise")); the check must not report it in the
    caller's program, as it did not before the output was read through a cast."""
    np = pytest.importorskip("numpy")
    snan = torch.tensor([0x7FA00000], dtype=torch.int32).view(torch.float32)

    def f(x):
        return torch.cat([x * 2, snan])

    x = torch.ones(3, requires_grad=True)
    before = np.seterr(all=setting)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = remat(f)(x)
            y[:3].sum().backward()
    finally:
        np.seterr(**before)
    assert_close(x.grad, torch.full((3,), 2.0))


class _ScaledAdapter(torch.nn.Module):
    """``base(x) + scaling * b(x)``, as PEFT's LoRA layer computes, ``scaling`` a Python number
    that diffusers multiplies for the duration of the model's forward only
    (``cross_attention_kwargs={"scale": s}``: ``scale_layer`` before, ``unscale_layer`` after)."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(4, 4).double()
        self.b = torch.nn.Linear(4, 4, bias=False).double()
        self.scaling = 2.0

    def forward(self, x):
        return self.base(x) + self.scaling * self.b(x)


def test_a_module_attribute_set_for_the_forward_pass_only_raises_saying_to_set_it_for_the_step():
    """The caller scales the layer for its forward pass and puts the scale back before the
    backward pass: the recomputation computes with the other scale. remat refuses it, and says to
    set the scale for the whole step (``torch.utils.checkpoint`` recomputes the saved activations
    of the other scale, silently). Set for the whole step, the gradients are the function's."""
    torch.manual_seed(0)
    layer = _ScaledAdapter()
    x = torch.randn(3, 4, dtype=torch.float64)

    def step(layer, call, scale_for_forward_only):
        layer.zero_grad()
        if scale_for_forward_only:
            layer.scaling *= 0.5
        y = call(x)
        if scale_for_forward_only:
            layer.scaling /= 0.5
        (y.tanh() * torch.arange(12.0, dtype=torch.float64).reshape(3, 4)).sum().backward()
        return {n: p.grad.clone() for n, p in layer.named_parameters()}

    expected = step(layer, layer, scale_for_forward_only=True)
    with pytest.raises(CheckpointError, match=r"did not reproduce.*set_adapters\(\.\.\., weights=\[s\]\)"):
        step(layer, remat(layer), scale_for_forward_only=True)
    layer.scaling = 1.0  # (set for the whole step: forward and backward)
    assert_close(step(layer, remat(layer), scale_for_forward_only=False), expected)


_MOVES = {
    "rolled by a counter": lambda y, calls: torch.roll(y, shifts=calls, dims=0),
    "rows reversed on every other call": lambda y, calls: y.flip(0) if calls % 2 == 0 else y,
}
_LAYOUTS = {
    "transposed": lambda y: y.t(),
    "columns of a wider tensor": lambda y: torch.cat([y, y], 1)[:, ::2],
    "contiguous": lambda y: y,
}


def _moving(change, layout, rows):
    """``layout(change(tanh(x @ w), n))`` on the n-th call: the same sum and norm on every call, the
    values elsewhere (the reference, called once, is the function without remat)."""
    calls = []
    w = torch.randn(6, 6, dtype=D, generator=torch.Generator().manual_seed(0))
    x = torch.randn(rows, 6, dtype=D, generator=torch.Generator().manual_seed(1))

    def f(x):
        calls.append(1)
        return layout(change(torch.tanh(x @ w), len(calls)))

    return f, x


@pytest.mark.parametrize("rows", [4, 1000], ids=["small", "large"])
@pytest.mark.parametrize("layout", ["transposed", "columns of a wider tensor"])
@pytest.mark.parametrize("change", list(_MOVES))
@pytest.mark.parametrize("how", ["backward", "grad", "vjp"])
def test_a_non_contiguous_output_with_the_same_sum_and_norm_but_other_values_raises(how, change, layout, rows):
    """The position-weighted sum is of the values in their logical order, whatever the output's
    layout: a recomputation that moves the values of a transposed or strided output (which its
    sum and norm do not see) is refused, not differentiated silently at the wrong places."""
    f, x = _moving(_MOVES[change], _LAYOUTS[layout], rows)
    g = remat(f)
    with pytest.raises(CheckpointError, match="other values"):
        if how == "backward":
            g(x.requires_grad_()).sum().backward()
        elif how == "grad":
            tf.grad(lambda x: g(x).square().sum())(x)
        else:
            out, vjp_fn = tf.vjp(g, x)
            vjp_fn(torch.ones_like(out))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("change", list(_MOVES))
@pytest.mark.parametrize("how", ["vmap_grad", "grad_of_vmap", "vmap_vjp", "jacrev", "vmap_then_backward", "vmap_vmap_grad"])
def test_a_recomputation_under_vmap_with_the_same_sum_and_norm_but_other_values_raises(how, change, layout):
    """Under vmap (and jacrev, which vmaps the backward) the digest is of the plain tensor under the
    batching wrappers, whose batch dimensions a run may lay out anywhere: the position-weighted sum
    reads it with its batch dimensions first, so it is taken there too, and a recomputation that moves
    values is refused as without a transform."""
    f, x = _moving(_MOVES[change], _LAYOUTS[layout], 4)
    g = remat(f)
    xs = torch.stack([x, x.cos(), x.sin()])
    with pytest.raises(CheckpointError, match="other values"):
        if how == "vmap_grad":
            tf.vmap(tf.grad(lambda x: g(x).square().sum()))(xs)
        elif how == "grad_of_vmap":
            tf.grad(lambda xs: tf.vmap(g)(xs).square().sum())(xs)
        elif how == "vmap_vjp":
            tf.vmap(lambda x: (lambda out, vjp_fn: vjp_fn(torch.ones_like(out)))(*tf.vjp(g, x)))(xs)
        elif how == "jacrev":
            tf.jacrev(g)(x)
        elif how == "vmap_then_backward":
            tf.vmap(g)(xs.requires_grad_()).square().sum().backward()
        else:
            tf.vmap(tf.vmap(tf.grad(lambda x: g(x).square().sum())), in_dims=1)(torch.stack([xs, xs.exp()], 1))


@pytest.mark.parametrize("how", ["vmap_grad", "vmap_vmap_grad", "jacrev", "vmap_jacrev", "grad_of_vmap"])
def test_batched_outputs_of_any_layout_raise_no_false_alarm(how):
    """A deterministic function whose outputs under vmap sit in other layouts (batch dimensions moved,
    transposed, strided, a view of the input) gives the function's values and gradients: the
    position-weighted sums of its two runs read the values in the same order."""
    w = torch.randn(6, 6, dtype=D, generator=torch.Generator().manual_seed(0))

    def f(x):
        h = torch.tanh(x @ w)
        return h.t(), torch.cat([h, h], 1)[:, ::2], F.layer_norm(h, (6,)).t().contiguous().t(), x.t()

    def loss(fn):
        return lambda x: sum(o.sin().sum() * (k + 1) for k, o in enumerate(fn(x)))

    x = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(1))
    xs = torch.stack([x, x.cos(), x.sin()], 2)

    def run(fn):
        if how == "vmap_grad":
            return tf.vmap(tf.grad(loss(fn)), in_dims=2, out_dims=1)(xs)
        if how == "vmap_vmap_grad":
            return tf.vmap(tf.vmap(tf.grad(loss(fn)), in_dims=2), in_dims=0, out_dims=2)(torch.stack([xs, xs.exp()]))
        if how == "jacrev":
            return tf.jacrev(fn)(x)
        if how == "vmap_jacrev":
            return tf.vmap(tf.jacrev(fn), in_dims=2)(xs)
        return tf.grad(lambda xs: loss(tf.vmap(fn, in_dims=2, out_dims=(1, 0, 2, 1)))(xs))(xs)

    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("how", ["backward", "vmap_grad"])
def test_an_integer_output_the_recomputation_lays_out_otherwise_raises_no_false_alarm(how, dtype):
    """An integer output's values are exact, but the sum of their squares is rounded, in the order of
    its layout: a recomputation that returns the same values transposed in memory (or under vmap with
    the batch dimension elsewhere) reproduces the forward pass, and the gradients are the function's."""
    calls = []

    def f(x):
        calls.append(1)
        ids = (x * 1e6).to(dtype)
        return x.sin(), ids.t().contiguous().t() if len(calls) % 2 == 0 else ids

    x = torch.randn(3000, 7, dtype=D, generator=torch.Generator().manual_seed(15)) * 1e3

    def run(fn):
        if how == "backward":
            x_ = x.clone().requires_grad_()
            fn(x_)[0].sum().backward()
            return x_.grad
        return tf.vmap(tf.grad(lambda x: fn(x)[0].sum()))(torch.stack([x, -x]))

    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("cut", ["detach", "no_grad", "requires_grad_(False) on a copy"])
@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_a_recomputation_that_cuts_an_output_off_its_inputs_raises(how, cut):
    """A flag changed between the forward and the backward pass that makes the function detach its
    output (a frozen branch, a stop-gradient switch) leaves its values as they were: the value check
    passes, and the recomputed graph no longer reaches the inputs. The gradient the function without
    remat computes from the forward run's graph would be silently missing (None): refused instead."""
    flag = {"train": True}
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def f(x):
        y = torch.tanh(x @ w)
        if flag["train"]:
            return y
        if cut == "detach":
            return y.detach()
        if cut == "no_grad":
            with torch.no_grad():
                return torch.tanh(x @ w)
        return y.detach().clone().requires_grad_(False)

    x = X.clone().requires_grad_()
    y = remat(f)(x)
    flag["train"] = False
    with pytest.raises(CheckpointError, match="depends differentiably on the inputs in the forward pass"):
        if how == "backward":
            y.sum().backward()
        else:
            torch.autograd.grad(y.sum(), (x, w))
    flag["train"] = True  # the flag as at the call: the function's gradients
    y = remat(f)(x)
    assert_close(torch.autograd.grad(y.sum(), (x, w)), torch.autograd.grad(f(x).sum(), (x, w)))


def test_outputs_that_never_depend_on_the_inputs_raise_no_false_alarm():
    """Outputs the function detaches (or computes without grad) on every call, beside differentiable
    ones, and a backward pass asking for one input's gradient only: the gradients are the function's."""
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def f(x):
        y = torch.tanh(x @ w)
        with torch.no_grad():
            z = y * 2
        return y, y.detach(), z, (x > 0).sum()

    x = X.clone().requires_grad_()
    for wrt in ((x, w), (x,), (w,)):
        got = torch.autograd.grad(remat(f)(x)[0].sum(), wrt)
        assert_close(got, torch.autograd.grad(f(x)[0].sum(), wrt))
