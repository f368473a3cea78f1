"""Random ops replay exactly during recomputation, and the caller's RNG never notices."""

import pytest
import torch
import torch.func as tf
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import funckpt
from funckpt import CheckpointError, remat
from tests.fakes import LiveBf16Casts

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


def assert_as_without_remat(run, fn):
    """``run(remat(fn))`` gives ``run(fn)``'s result and leaves the CPU generator where it does."""
    expected, state_expected = seeded(lambda: run(fn))
    got, state_got = seeded(lambda: run(remat(fn)))
    assert_close(got, expected)
    assert torch.equal(state_got, state_expected)


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

    assert_as_without_remat(run, noisy)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_randomness_modes(randomness):
    def run(fn):
        return tf.vmap(tf.grad(lambda w, x: fn(w, x).sum()), in_dims=(None, 0), randomness=randomness)(W, X)

    assert_as_without_remat(run, noisy)


def test_vmap_randomness_error_raises_as_torch_func_does():
    with pytest.raises(RuntimeError, match="randomness"):
        tf.vmap(remat(noisy), in_dims=(None, 0))(W, X)


def _dropout_of(w):
    return torch.nn.functional.dropout(w, p=0.5)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_of_a_call_whose_inputs_are_all_unbatched_draws_as_without_remat(randomness):
    """Under ``vmap(randomness="different")`` a random operator on unbatched tensors draws per
    example: torch.func runs a Function none of whose inputs is batched below the vmap, so remat
    takes the vmap's rule itself, forward (the values) and backward (per-example gradients)."""
    w = W[0]

    def forward(fn):
        return tf.vmap(lambda x: x * fn(w), randomness=randomness)(X)

    def per_example_grads(fn):
        return tf.vmap(tf.grad(lambda w, x: (x * fn(w)).sum()), in_dims=(None, 0), randomness=randomness)(w, X)

    def jacobian(fn):
        return tf.jacfwd(lambda w: fn(w) * w, randomness=randomness)(w)

    for run in (forward, per_example_grads, jacobian):
        assert_as_without_remat(run, _dropout_of)


@pytest.mark.parametrize("inner, outer", [("same", "different"), ("different", "different"), ("different", "same")])
def test_nested_vmaps_of_a_call_whose_inputs_are_all_unbatched_draw_as_without_remat(inner, outer):
    w, xs = W[0], torch.randn(3, 2, 6, dtype=D)

    def forward(fn):
        return tf.vmap(tf.vmap(lambda x: x * fn(w), randomness=inner), randomness=outer)(xs)

    def per_example_grads(fn):
        grad = tf.grad(lambda w, x: (x * fn(w)).sum())
        return tf.vmap(tf.vmap(grad, in_dims=(None, 0), randomness=inner), in_dims=(None, 0), randomness=outer)(w, xs)

    for run in (forward, per_example_grads):
        assert_as_without_remat(run, _dropout_of)


def test_vmap_of_jacrev_and_of_a_checkpointed_loop_drawing_per_example():
    import funckpt

    w = W[0]

    def jacobians(fn):
        return tf.vmap(tf.jacrev(lambda w, x: x * fn(w)), in_dims=(None, 0), randomness="different")(w, X)

    def loop_grads(fn):
        step = lambda c, _: (fn(c.sin()), None)  # noqa: E731
        loop = lambda c: funckpt.scan(step, c, None, length=4)[0]  # noqa: E731
        return tf.vmap(tf.grad(lambda w, x: (x * loop(w)).sum()), in_dims=(None, 0), randomness="different")(w, X)

    assert_as_without_remat(jacobians, _dropout_of)
    expected, _ = seeded(lambda: loop_grads(_dropout_of))
    got, _ = seeded(lambda: loop_grads(lambda c: remat(_dropout_of)(c)))
    assert_close(got, expected)


def test_a_call_whose_inputs_are_all_unbatched_returns_what_the_function_does_under_vmap():
    """Without random operators the call's outputs are the function's: unbatched inside the vmap,
    so the caller may write them in place, read them as numbers, return them unbatched."""
    w = W[0]

    def f(w):
        return w.sin() * 2

    def run(fn):
        def body(x):
            out = fn(w)
            out.mul_(2)
            return out * float(out.sum()) if bool(out.any()) else out, x.sum()

        return tf.vmap(body, out_dims=(None, 0))(X)

    assert_as_without_remat(run, f)


def test_a_random_call_whose_inputs_are_unbatched_under_vmap_inside_grad_is_refused():
    """``grad(vmap(f, randomness="different"))``: the call must be recorded for the enclosing grad,
    and torch.func runs it once for the whole batch: one sample where the function without remat
    draws one per example. remat says so rather than return one draw for all."""
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="batched there"):
        tf.grad(lambda w: tf.vmap(lambda x: x * remat(_dropout_of)(w), randomness="different")(X).sum())(W[0])
    assert torch.equal(torch.get_rng_state(), before), "the refused call's draw moved the generator"


def test_vmap_randomness_error_raises_on_a_call_whose_inputs_are_all_unbatched():
    with pytest.raises(RuntimeError, match="randomness"):
        tf.vmap(lambda x: x * remat(_dropout_of)(W[0]))(X)


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


def explicit_noise(w, x, generator):
    h = torch.tanh(x @ w)
    mask = torch.rand(h.shape, generator=generator, dtype=D) > 0.5
    return h * mask * torch.randn(h.shape, generator=generator, dtype=D)


@pytest.mark.parametrize("where", ["argument", "nested_argument", "closure"])
def test_explicit_generator_is_threaded_and_not_advanced_by_recomputation(where):
    def run(wrap):
        g = torch.Generator().manual_seed(99)
        if where == "argument":
            fn = wrap(explicit_noise)
            out = tf.grad(lambda w: fn(w, X, g).square().sum())(W)
        elif where == "nested_argument":
            fn = wrap(lambda w, x, cfg: explicit_noise(w, x, cfg["rng"]))
            out = tf.grad(lambda w: fn(w, X, {"rng": g, "p": 0.5}).square().sum())(W)
        else:
            fn = wrap(lambda w, x: explicit_noise(w, x, g))
            out = tf.grad(lambda w: fn(w, X).square().sum())(W)
        return out, g.get_state()

    expected, state_expected = run(lambda f: f)
    got, state_got = run(remat)
    assert_close(got, expected)
    assert torch.equal(state_got, state_expected)


@pytest.mark.parametrize("how", ["checkpoint", "remat"])
def test_a_recomputation_context_that_draws_leaves_the_callers_generators_where_they_were(how):
    """A ``context_fn`` context that draws random numbers (entering and leaving) in the recomputation
    moves neither the CPU generator nor an explicit one the function draws from: the backward pass
    leaves them where the forward pass did, as ``torch.utils.checkpoint``'s ``fork_rng`` does. The
    values and gradients are those of the function without remat run inside the forward context."""
    gen = torch.Generator()

    class Draws:
        def __enter__(self):
            torch.rand(3)
            torch.rand(3, generator=gen)

        def __exit__(self, *exc):
            torch.rand(2)
            torch.rand(2, generator=gen)

    def context_fn():
        return Draws(), Draws()

    def fn(w, x):
        return noisy(w, x) * torch.rand(x.shape, generator=gen, dtype=D)

    def run(call):
        torch.manual_seed(3)
        gen.manual_seed(4)
        w = W.clone().requires_grad_()
        out = call(w, X).square().sum()
        after_forward = torch.get_rng_state(), gen.get_state()
        out.backward()
        return out.detach(), w.grad, after_forward, (torch.get_rng_state(), gen.get_state())

    def without_remat(w, x):
        with Draws():
            return fn(w, x)

    def rematted(w, x):
        if how == "checkpoint":
            return funckpt.checkpoint(fn, w, x, use_reentrant=False, context_fn=context_fn)
        return remat(fn, context_fn=context_fn)(w, x)

    got, expected = run(rematted), run(without_remat)
    assert_close(got[:2], expected[:2])
    states = (*got[2], *got[3], *expected[2], *expected[3])
    assert all(torch.equal(s, states[i % 2]) for i, s in enumerate(states)), "a generator moved in the backward pass"


def test_rng_devices_cover_every_non_cpu_device_type():
    from funckpt._rng import accelerator_devices

    meta = torch.empty(2, device="meta")
    assert accelerator_devices([torch.empty(2), meta]) == []


def test_recomputation_runs_under_the_forward_autocast_state():
    dtypes = []

    def f(w, x):
        y = x @ w
        dtypes.append(y.dtype)
        return y.float().sin()

    w32, x32 = W.float().requires_grad_(), X.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = remat(f)(w32, x32)
    out.sum().backward()  # outside the autocast block
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    w_ref = W.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = f(w_ref, x32)
    ref.sum().backward()
    assert_close(w32.grad, w_ref.grad)


def test_recomputation_runs_without_autocast_when_the_forward_had_none():
    dtypes = []

    def f(w, x):
        y = x @ w
        dtypes.append(y.dtype)
        return y.sin()

    w32 = W.float().requires_grad_()
    out = remat(f)(w32, X.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.sum().backward()  # inside an autocast block the forward did not see
        assert torch.is_autocast_enabled("cpu")  # the block's state is as it was
    assert dtypes == [torch.float32, torch.float32]
    w_ref = W.float().requires_grad_()
    ref = f(w_ref, X.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref.sum().backward()
    assert_close(w32.grad, w_ref.grad)


class _DoubledSines(TorchFunctionMode):
    """A mode of the user's that changes what a function computes: every sine doubled. Counts
    how often it is entered (the caller's ``with``: once)."""

    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func in (torch.sin, torch.Tensor.sin) else out


def _sines(w, x):
    return (x @ w).sin().square() * x


_UNDER_A_MODE = {
    ".backward()": lambda f, w, x: torch.autograd.grad(f(w, x).sum(), w),
    "torch.func.grad": lambda f, w, x: tf.grad(lambda w: f(w.view_as(w), x).sum())(w.detach()),
    "vmap(grad)": lambda f, w, x: tf.vmap(tf.grad(lambda w, x: f(w, x).sum()), in_dims=(None, 0))(w.detach(), x),
    "jacrev": lambda f, w, x: tf.jacrev(lambda w: f(w, x))(w.detach()),
    "jvp": lambda f, w, x: tf.jvp(lambda w: f(w, x), (w.detach(),), (torch.ones_like(w),))[1],
}
def _twice(w, x):
    return _sines(w, _sines(w, x))


#: Per way of checkpointing: the function without it, and with it.
_WRAPPED = {
    "remat": (_sines, remat(_sines)),
    "funckpt.checkpoint": (_sines, lambda w, x: funckpt.checkpoint(_sines, w, x, use_reentrant=False)),
    "scan": (_twice, lambda w, x: funckpt.scan(lambda c, _: (_sines(w, c), None), x, length=2, checkpoints=1)[0]),
}


@pytest.mark.parametrize("wrapped", list(_WRAPPED))
@pytest.mark.parametrize("how", list(_UNDER_A_MODE))
def test_every_run_is_under_the_callers_torch_function_modes(how, wrapped):
    """The autograd engine runs a backward pass without the caller's torch-function modes, and under
    a torch.func transform the Function's forward runs with them off: each run of the function
    has them back, as the function without remat runs under them, entered once by the caller."""
    plain, checkpointed = _WRAPPED[wrapped]
    w = W.clone().requires_grad_()
    with _DoubledSines():
        expected = _UNDER_A_MODE[how](plain, w, X)
    _DoubledSines.entered = 0
    with _DoubledSines():
        got = _UNDER_A_MODE[how](checkpointed, w, X)
    assert_close(got, expected)
    assert _DoubledSines.entered == 1


class _SinesPlusOne(TorchFunctionMode):
    """A context_fn's mode that does not commute with :class:`_DoubledSines`: every sine plus one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1 if func in (torch.sin, torch.Tensor.sin) else out


@pytest.mark.parametrize("how", list(_UNDER_A_MODE))
def test_the_callers_torch_function_modes_stay_under_a_context_fns(how):
    """The caller's modes are outside what ``context_fn`` enters around each run, as around the
    forward run under plain autograd: pushed back below it, not on top of it (a recomputation
    under the two in the other order computes another thing: 'did not reproduce', or under
    torch.func a silently wrong gradient)."""

    def plain(w, x):
        with _SinesPlusOne():
            return _sines(w, x)

    def checkpointed(w, x):
        contexts = lambda: (_SinesPlusOne(), _SinesPlusOne())  # noqa: E731
        return funckpt.checkpoint(_sines, w, x, use_reentrant=False, context_fn=contexts)

    w = W.clone().requires_grad_()
    with _DoubledSines():
        expected = _UNDER_A_MODE[how](plain, w, X)
    with _DoubledSines():
        got = _UNDER_A_MODE[how](checkpointed, w, X)
    assert_close(got, expected)


@pytest.mark.parametrize("how", [".backward()", "torch.func.grad", "vmap(grad)"])
def test_every_run_makes_tensors_on_the_callers_default_device(how):
    """``with torch.device(...)`` is a torch-function mode: factory calls in the forward run and
    in the recomputation make their tensors where the caller's do."""
    devices = []

    def f(w, x):
        devices.append(torch.empty(2).device.type)
        return (x @ w).sin()

    with torch.device("meta"):
        _UNDER_A_MODE[how](remat(f), W.clone().requires_grad_(), X)
    assert devices == ["meta", "meta"]


def test_autocast_cache_keeps_no_cast_of_a_calls_own_leaves():
    """Autocast caches the cast of every leaf requiring grad until its block exits; a remat'd
    call's runs make leaves of their own of its inputs. Cached, the casts of every call's input
    and weights stayed alive to the end of the forward pass (more than without checkpointing);
    remat keeps none, and torch.utils.checkpoint keeps those of the weights."""
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)

    def alive_at_the_end_of_the_forward(call):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with LiveBf16Casts() as casts:
                h = x * 1
                for _ in range(6):
                    h = h + call(h).float()  # a float32 residual stream through one shared layer
            alive = casts.alive()
        h.sum().backward()
        return alive

    by_torch = alive_at_the_end_of_the_forward(lambda h: checkpoint(layer, h, use_reentrant=False))
    assert alive_at_the_end_of_the_forward(remat(layer)) <= by_torch


@pytest.mark.parametrize("nested", [False, True])
def test_autocast_cache_raises_no_false_alarm_on_a_leaf_the_function_makes(nested):
    """A leaf fn makes itself (a module built in the call), or a no-op cast of a nested call's
    input, cached by autocast: not a tensor that outlived the call."""

    def made_inside(w, x):
        b = torch.ones(8, 8, requires_grad=True)
        return x @ b + x @ w.float()

    f = (lambda w, x: remat(made_inside)(w, x)) if nested else made_inside
    w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    # (the reference without the cache: with it, x is cast once for both matmuls, and its
    # gradient summed in bfloat16 rather than float32; see the README's autocast note)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        expected = torch.autograd.grad(made_inside(w, x).float().sum(), (w, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad(remat(f)(w, x).float().sum(), (w, x))
    assert_close(got, expected)


def test_jacrev_through_random_ops():
    def f(x):
        return torch.nn.functional.dropout(x.sin(), 0.5) * 2

    expected, _ = seeded(lambda: tf.jacrev(f)(X[0]))
    got, _ = seeded(lambda: tf.jacrev(remat(f))(X[0]))
    assert_close(got, expected)


def test_an_autocast_torch_reports_separately_is_not_taken_for_off(monkeypatch):
    """torch's one-call check misses an MPS-only autocast: capture must still record the state."""
    from funckpt import _autocast

    monkeypatch.setattr(torch._C, "_is_any_autocast_enabled", lambda: False)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type="cpu": device_type == "mps")
    monkeypatch.setattr(_autocast, "_MPS", True)  # a torch built with MPS (only there is it asked)
    assert _autocast.capture([]) is not _autocast.OFF


# A dropout's mask depends on its input's layout in torch, differently with and without
# torch.func transforms (funckpt/_draws.py): outside them ATen's kernel draws a non-contiguous
# input's mask in memory order, under any of them functorch's own kernel draws it in
# row-major order. remat runs the function where the caller's transforms are not all active
# (one level lower, or under a vjp of its own): its masks must still be the function's.

_DROPOUTS = {
    "dropout": lambda r: torch.nn.functional.dropout(r, 0.5),
    "in_place": lambda r: torch.nn.Dropout(0.3, inplace=True)(r * 1),
    "alpha": lambda r: torch.nn.functional.alpha_dropout(r, 0.4, training=True),
}


def _on_columns(drop):
    """``drop`` of a column-major (non-contiguous) tensor, as of ``conv1d(...).transpose(1, 2)``."""
    return lambda w, x: drop(torch.tanh(x @ w).t().contiguous().t()).sin()


def _twice(fn):
    return lambda w, x: fn(w, fn(w, x)) * 1.5


_DRAWING_TRANSFORMS = {
    "grad": lambda fn: tf.grad(lambda w, x: _twice(fn)(w, x).sum(), argnums=(0, 1))(W, X),
    "vjp": lambda fn: tf.vjp(_twice(fn), W, X)[1](torch.ones_like(X)),
    "jacrev": lambda fn: tf.jacrev(_twice(fn), argnums=(0, 1))(W, X[:2]),
    "jacfwd": lambda fn: tf.jacfwd(_twice(fn), argnums=(0, 1), randomness="same")(W, X[:2]),
    "jvp": lambda fn: tf.jvp(_twice(fn), (W, X), (torch.ones_like(W), X)),
    "jvp_of_grad": lambda fn: tf.jvp(tf.grad(lambda w: _twice(fn)(w, X).sum()), (W,), (torch.ones_like(W),)),
    "grad_of_grad": lambda fn: tf.grad(lambda w: tf.grad(lambda v: _twice(fn)(v, X).sum())(w).sin().sum())(W),
    # made under plain autograd, differentiated under torch.func's vmap (the recomputation then
    # runs under a torch.func.vjp, where functorch's kernel is in force)
    "vmapped_backward": lambda fn: (
        lambda w, y: tf.vmap(lambda v: torch.autograd.grad(y, w, v, retain_graph=True)[0])(torch.stack([y, -y]))
    )(*(lambda w: (w, _twice(fn)(w, X)))(W.clone().requires_grad_())),
}


@pytest.mark.parametrize("drop", list(_DROPOUTS))
@pytest.mark.parametrize("transform", list(_DRAWING_TRANSFORMS))
def test_dropout_of_a_non_contiguous_tensor_draws_as_without_remat(transform, drop):
    """Same mask, values and gradients as the function without remat, under every transform;
    no recomputation that draws another mask (a false CheckpointError)."""
    assert_as_without_remat(_DRAWING_TRANSFORMS[transform], _on_columns(_DROPOUTS[drop]))


def _per_example_grads(randomness):
    grad = tf.grad(lambda w, x, fn: fn(w, x).sum())
    return lambda fn: tf.vmap(grad, in_dims=(None, 0, None), randomness=randomness)(W, X[:, None], fn)


@pytest.mark.parametrize(
    "transform",
    [
        _per_example_grads("different"),
        _per_example_grads("same"),
        lambda fn: tf.grad(lambda w: tf.vmap(lambda x: fn(w, x), randomness="same")(X[:, None]).sum())(W),
        lambda fn: _backward(_twice(fn)),
    ],
    ids=["vmap_of_grad_different", "vmap_of_grad_same", "grad_of_vmap", "backward"],
)
def test_dropout_of_a_non_contiguous_tensor_where_the_kernel_does_not_change(transform):
    """Where every run of the function has the caller's kernel (a vmap stays below the grad
    level remat steps under; plain autograd has no transform at all), masks stay as they were."""
    assert_as_without_remat(transform, _on_columns(_DROPOUTS["dropout"]))


def _backward(fn):
    w = W.clone().requires_grad_()
    return torch.autograd.grad(fn(w, X).sum(), w, create_graph=True)[0]


def test_transformer_layer_in_training_under_functional_call_draws_as_without_remat():
    """``nn.TransformerEncoderLayer(batch_first=True)`` drops out its attention's output transposed
    back to batch-first (non-contiguous): a training step and a Jacobian as without remat."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True).to(D).train()
    x, params = torch.randn(2, 5, 8, dtype=D), dict(layer.named_parameters())

    def step(module):
        return lambda: tf.grad_and_value(lambda p: tf.functional_call(module, p, (x,)).sin().sum())(params)

    def jacobian(module):
        return lambda: tf.jacrev(lambda x: module(x).sum(-1))(x)

    for run in (step, jacobian):
        (expected, state_expected), (got, state_got) = seeded(run(layer)), seeded(run(remat(layer)))
        assert_close(got, expected)
        assert torch.equal(state_got, state_expected)


def test_channels_last_dropout_in_a_nested_call_and_a_checkpointed_loop_draws_as_without_remat():
    """A channels-last convolution's output dropped out: in a remat'd call nested in another, and
    in each step of a checkpointed loop reversed under grad and jacrev."""
    import funckpt

    conv = torch.nn.Conv2d(3, 3, 3, padding=1).to(D)
    x = torch.randn(2, 3, 5, 5, dtype=D).contiguous(memory_format=torch.channels_last)

    def block(t):
        return torch.nn.functional.dropout(conv(t), 0.5).tanh()

    def nested(r):
        return lambda t: r(lambda u: r(block)(u.cos()) * 2)(t)

    def loop(r):
        if r is not remat:
            return lambda t: block(block(block(t)))
        return lambda t: funckpt.scan(lambda c, _: (block(c), None), t, None, length=3, checkpoints=2)[0]

    def grad(fn):
        return tf.grad(lambda t: fn(t).sum())(x)

    def jacobian(fn):
        return tf.jacrev(lambda t: fn(t).sum((1, 2, 3)))(x)

    for make in (nested, loop):
        for run in (grad, jacobian):
            expected, _ = seeded(lambda: run(make(lambda fn: fn)))
            got, _ = seeded(lambda: run(make(remat)))
            assert_close(got, expected)


def test_dropout_of_a_non_contiguous_tensor_with_a_saving_policy_draws_as_without_remat():
    """A policy's kept values are matched with the recomputation's operators: its redrawn dropout
    runs the operators functorch's kernel runs, in the same order."""
    from funckpt import policies

    for policy in (policies.dots_saveable, policies.everything_saveable):
        for run in (_DRAWING_TRANSFORMS["grad"], _DRAWING_TRANSFORMS["jacrev"]):
            expected, _ = seeded(lambda: run(_on_columns(_DROPOUTS["alpha"])))
            got, _ = seeded(lambda: run(remat(_on_columns(_DROPOUTS["alpha"]), policy=policy)))
            assert_close(got, expected)


@pytest.mark.parametrize("transform", ["grad", "backward"])
def test_in_place_dropout_of_a_non_contiguous_input_draws_as_without_remat(transform):
    """An input that is not differentiated, dropped out in place: snapshotted before the redrawn
    dropout writes it (the write watch sees the redrawn call's write), then recomputed from it."""

    def f(x, m):
        torch.nn.functional.dropout(m, 0.5, inplace=True)
        return (x * m).sin()

    def column_major():
        return X.t().contiguous().t().cos()  # (made at the caller's level: torch.func refuses writes to others)

    def run(fn):
        if transform == "grad":
            return tf.grad(lambda x: fn(x, column_major()).sum())(X)
        x = X.clone().requires_grad_()
        return torch.autograd.grad(fn(x, column_major()).sum(), x)[0]

    assert_as_without_remat(run, f)


# A generator only a custom autograd.Function's forward draws from (a module global): under a
# torch.func transform Function.apply passes through the substitution mode as one operator, whose
# forward's draws the mode does not see; the generator is found from the Function's code instead.
_FUNCTION_ONLY_GENERATOR = torch.Generator().manual_seed(0)


class _ScaledByNoise(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * torch.rand(x.shape, generator=_FUNCTION_ONLY_GENERATOR, dtype=x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        return g * out / x


@pytest.mark.parametrize("how", ["backward", "grad", "vmap_grad", "vmap_backward", "scan_vmap_grad"])
@pytest.mark.parametrize("check", ["default", "none"])
def test_a_generator_only_a_custom_functions_forward_draws_from_is_replayed(how, check):
    """The remat'd function only calls the Function; its draws replay under every transform, vmap
    too, with the gradient and the generator's state after the call as without remat."""
    options = {} if check == "default" else {"determinism_check": "none"}

    def f(x):
        return (_ScaledByNoise.apply(x.sin()) * x).sum()

    def g(c):  # (a checkpointed loop of such steps)
        return funckpt.scan(lambda c, _: (_ScaledByNoise.apply(c.sin() + 1), None), c, None, length=3, checkpoints=2)[0].sum()

    def g_plain(c):
        for _ in range(3):
            c = _ScaledByNoise.apply(c.sin() + 1)
        return c.sum()

    def run(fn):
        _FUNCTION_ONLY_GENERATOR.manual_seed(0)
        x = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(1))
        if how == "backward":
            x.requires_grad_()
            out = torch.autograd.grad(fn(x), x)[0]
        elif how == "grad":
            out = tf.grad(fn)(x)
        elif how == "vmap_backward":
            x.requires_grad_()
            out = torch.autograd.grad(tf.vmap(fn, randomness="different")(x).sum(), x)[0]
        else:
            out = tf.vmap(tf.grad(fn), randomness="different")(x)
        return out, _FUNCTION_ONLY_GENERATOR.get_state()

    plain, remat_d = (g_plain, funckpt.remat(g, **options)) if how.startswith("scan") else (f, remat(f, **options))
    expected, state = run(plain)
    got, state_after = run(remat_d)
    assert_close(got, expected)
    assert torch.equal(state_after, state)


# ---------------------------------------------------------------- make_fx records no generator state


def _dropout_block() -> tuple[torch.Tensor, object]:
    w = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x @ w, 0.5, training=True).sin()

    return w, f


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_a_recomputation_make_fx_records_with_a_random_draw_is_refused(tracing_mode):
    """make_fx records no Generator.set_state: in its graph the recomputation's dropout would draw
    another mask than the forward pass's (the graph had two independent bernoulli draws, and its
    gradient was silently wrong). Refused when the recomputation is recorded."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):  # (w an argument: a fake or symbolic trace takes no real tensor from a closure)
        return torch.nn.functional.dropout(x @ w, 0.5, training=True).sin()

    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(CheckpointError, match="recorded into a graph by make_fx"):
        make_fx(tf.grad(lambda x, w: remat(f)(x, w).pow(2).sum()), tracing_mode=tracing_mode)(x, w)
    with pytest.raises(CheckpointError, match="recorded into a graph by make_fx"):
        make_fx(lambda x, w: torch.autograd.grad(remat(f)(x, w).pow(2).sum(), x)[0], tracing_mode=tracing_mode)(x.requires_grad_(), w)


def test_linearize_of_a_function_drawing_random_numbers_is_refused():
    """torch.func.linearize traces the jvp with make_fx: remat's jvp recomputes the function, and its
    dropout would draw another mask there than the one linearize's output was computed with."""
    _, f = _dropout_block()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(CheckpointError, match="recorded into a graph by make_fx"):
        tf.linearize(remat(f), x)


def test_make_fx_graphs_without_random_draws_or_recomputation_compute_as_without_remat():
    """What make_fx can record right is not refused: a recomputation that draws nothing, and the
    forward pass alone of a function that draws (no recomputation to record)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w, f = _dropout_block()
    x = torch.randn(3, 4, dtype=torch.float64)

    def g(x):
        return (x @ w).tanh() * x

    def grad_of(h):
        return make_fx(tf.grad(lambda x: h(x).pow(2).sum()))(x)(x)

    assert_close(grad_of(remat(g)), grad_of(g))
    torch.manual_seed(1)
    expected = make_fx(f)(x)
    torch.manual_seed(1)
    got = make_fx(remat(f))(x)
    torch.manual_seed(2)
    want = expected(x)
    torch.manual_seed(2)
    assert_close(got(x), want)


def test_dispatch_modes_that_record_no_graph_replay_random_draws_as_usual():
    """Only a graph tracer is refused: under a FlopCounterMode (and FakeTensorMode-free logging
    modes alike) the operators run as called, and the replay gives the forward pass's mask."""
    from torch.utils.flop_counter import FlopCounterMode

    _, f = _dropout_block()
    x = torch.randn(3, 4, dtype=torch.float64)

    def grad_with(h):
        torch.manual_seed(0)
        with FlopCounterMode(display=False):
            return tf.grad(lambda x: h(x).pow(2).sum())(x)

    assert_close(grad_with(remat(f)), grad_with(f))


@pytest.mark.parametrize("wrap", ["remat", "nested", "scan"])
@pytest.mark.parametrize("how", ["backward", "grad", "vjp", "vmap_grad"])
def test_the_recomputation_makes_tensors_of_the_default_dtype_at_the_call(how, wrap):
    """``torch.set_default_dtype`` between the forward and the backward pass: the recomputation's
    factory calls (``linspace``, ``torch.tensor``) make tensors of the dtype the forward run's made,
    and the gradients are the function's without remat (they were a false "did not reproduce"). The
    caller's default dtype is as it set it afterwards."""

    def f(w, x):
        return (x @ w).sin() * torch.linspace(0.1, 1.3, w.shape[1]) + torch.tensor(0.1)

    def checkpointed(rematted):
        wrapped = remat if rematted else (lambda fn: fn)
        if wrap == "remat":
            return wrapped(f)
        if wrap == "nested":
            inner = wrapped(f)
            return wrapped(lambda w, x: inner(w, inner(w, x) * 0.5))
        if not rematted:
            return lambda w, x: f(w, f(w, x))
        return lambda w, x: funckpt.scan(lambda c, _: (f(w, c), None), x, length=2, checkpoints=1)[0]

    def run(rematted):
        g = checkpointed(rematted)
        before = torch.get_default_dtype()
        torch.set_default_dtype(D)
        try:
            if how == "backward":
                w = W.clone().requires_grad_()
                y = g(w, X)
                torch.set_default_dtype(torch.float32)
                y.sum().backward()
                result = w.grad
            elif how == "vjp":
                out, vjp_fn = tf.vjp(lambda w: g(w, X), W)
                torch.set_default_dtype(torch.float32)
                result = vjp_fn(torch.ones_like(out))
            else:

                def loss(w, x):
                    y = g(w, x).sum()
                    torch.set_default_dtype(torch.float32)
                    return y

                if how == "grad":
                    result = tf.grad(loss)(W, X)
                else:
                    result = tf.vmap(tf.grad(loss), in_dims=(None, 0))(W, X.unsqueeze(1))
            assert torch.get_default_dtype() is torch.float32
            return result
        finally:
            torch.set_default_dtype(before)

    assert_close(run(True), run(False))


def test_a_checkpointed_loop_whose_steps_draw_is_refused_where_make_fx_records_its_backward():
    """A checkpointed loop's backward sweep runs its steps again from the generators' states it
    replays, which make_fx records no more than a remat'd call's: its graph drew each step's
    dropout again (13 draws for 5 steps), a silently wrong gradient where it runs. Refused as a
    recomputation is, from the same replay."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xs = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def step(c, x):
        c = torch.nn.functional.dropout(c @ w, 0.5, training=True).tanh() + x
        return c, c.sum()

    def loss(c):
        return funckpt.scan(step, c, xs, checkpoints=2)[0].pow(2).sum()

    c = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(CheckpointError, match="recorded into a graph by make_fx"):
        make_fx(tf.grad(loss))(c)
    with pytest.raises(CheckpointError, match="recorded into a graph by make_fx"):
        make_fx(lambda c: torch.autograd.grad(loss(c), c)[0])(c.clone().requires_grad_())
