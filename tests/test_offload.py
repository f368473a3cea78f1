"""Offload policies: values and gradients unchanged, reports say what was offloaded, and the
copy logic (side stream, prefetch, waits) runs in the right order.

No accelerator here: a CPU tensor is simply kept (the path tested first). The accelerator
path is exercised by registering a recording fake backend for "cpu" in ``_offload.BACKENDS``;
the CUDA backend implements the same three calls with streams and events.
"""

import pytest
import torch
import torch.func as tf
import torch.utils.checkpoint as upstream
from torch.testing import assert_close

import funckpt
from funckpt import _offload, _residuals, checkpoint_name, policies, remat
from tests.fakes import FakeBackend

D = torch.float64
aten = torch.ops.aten
W1 = torch.randn(6, 12, dtype=D, generator=torch.Generator().manual_seed(31))
W2 = torch.randn(12, 6, dtype=D, generator=torch.Generator().manual_seed(32))
X = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(33))


def block(w1, w2, x):
    h = checkpoint_name(torch.tanh(x @ w1), "hidden")
    return x + checkpoint_name(h.sin() @ w2, "out")


def stack(fn, depth=3):
    def loss(w1, w2, x):
        for _ in range(depth):
            x = fn(w1, w2, x)
        return x.square().sum()

    return loss


def _offload_mm(op, *args, **kwargs):
    return policies.Offload if op is aten.mm.default else False


def _torch_offload(ctx, op, *args, **kwargs):
    if op is aten.mm.default:
        return upstream.CheckpointPolicy.MUST_CPU_OFFLOAD
    if op is aten.tanh.default:
        return upstream.CheckpointPolicy.MUST_SAVE
    return upstream.CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "a function returning Offload": _offload_mm,
    "offload_dot_with_no_batch_dims": policies.offload_dot_with_no_batch_dims(),
    "offload_dot_with_no_batch_dims unpinned": policies.offload_dot_with_no_batch_dims(offload_dst="unpinned_host"),
    "save_and_offload_only_these_names": policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["hidden"], names_which_can_be_offloaded=["out"]
    ),
    "from_torch with MUST_CPU_OFFLOAD": policies.from_torch(_torch_offload),
    "save_from_both_policies with an offloading part": policies.save_from_both_policies(
        policies.save_only_these_names("hidden"), policies.offload_dot_with_no_batch_dims()
    ),
}


def _all_transforms(policy):
    f = stack(block)
    g = stack(remat(block, policy=policy))
    assert_close(g(W1, W2, X), f(W1, W2, X))
    assert_close(tf.grad(g, argnums=(0, 1))(W1, W2, X), tf.grad(f, argnums=(0, 1))(W1, W2, X))
    xs = torch.randn(3, 4, 6, dtype=D)
    assert_close(
        tf.vmap(tf.grad(g), in_dims=(None, None, 0))(W1, W2, xs), tf.vmap(tf.grad(f), in_dims=(None, None, 0))(W1, W2, xs)
    )
    assert_close(tf.jacrev(g, argnums=2)(W1, W2, X), tf.jacrev(f, argnums=2)(W1, W2, X))
    small = X[:1, :3].clone()
    w1, w2 = W1[:3, :4].clone(), W2[:4, :3].clone()
    assert_close(tf.hessian(g, argnums=2)(w1, w2, small), tf.hessian(f, argnums=2)(w1, w2, small))
    a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    g(a, b, X).backward()
    a0, b0 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    f(a0, b0, X).backward()
    assert_close((a.grad, b.grad), (a0.grad, b0.grad))


@pytest.mark.parametrize("name", POLICIES)
def test_offloading_policies_keep_values_and_gradients_on_cpu(name):
    _all_transforms(POLICIES[name])


def test_offload_verdicts_of_the_factories_and_from_torch():
    mm, sin = aten.mm.default, aten.sin.default
    assert policies.offload_dot_with_no_batch_dims()(mm) is policies.Offload
    assert policies.offload_dot_with_no_batch_dims()(sin) is False
    assert policies.offload_dot_with_no_batch_dims()(aten.bmm.default, torch.ones(2, 2, 2), torch.ones(2, 2, 2)) is False
    assert policies.offload_dot_with_no_batch_dims(offload_dst="unpinned_host")(mm) == policies.Offloadable(
        "device", "unpinned_host"
    )
    torch_policy = policies.from_torch(_torch_offload)
    assert torch_policy(mm) is policies.Offload and torch_policy(aten.tanh.default) is True and torch_policy(sin) is False
    prefer = policies.from_torch(lambda ctx, op, *a, **k: upstream.CheckpointPolicy.PREFER_CPU_OFFLOAD)
    assert prefer(sin) is policies.Offload
    # saving beats offloading beats recomputing
    both = policies.save_from_both_policies(policies.offload_dot_with_no_batch_dims(), policies.dots_saveable)
    assert both(mm) is True
    assert policies.save_from_both_policies(policies.nothing_saveable, policies.offload_dot_with_no_batch_dims())(mm) is policies.Offload
    assert repr(policies.save_and_offload_only_these_names(names_which_can_be_offloaded=("b", "a"))) == (
        "policies.save_and_offload_only_these_names(names_which_can_be_saved=(), names_which_can_be_offloaded=('a', 'b'))"
    )


def test_saved_residuals_say_which_kept_values_were_offloaded(capsys):
    policy = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["hidden"], names_which_can_be_offloaded=["out"]
    )
    rs = funckpt.saved_residuals(remat(block, policy=policy), W1, W2, X)
    kept = [(r.source, r.offloaded) for r in rs if r.kind == "saved by policy"]
    assert kept == [("aten.tanh.default named 'hidden'", False), ("aten.mm.default named 'out'", True)]
    assert not any(r.offloaded for r in rs if r.kind == "input")
    funckpt.print_saved_residuals(remat(block, policy=policy), W1, W2, X)
    printed = capsys.readouterr().out
    assert "offloaded by policy  aten.mm.default named 'out'" in printed
    assert "saved by policy      aten.tanh.default named 'hidden'" in printed
    assert "of it offloaded" in printed.splitlines()[-1]


def test_a_cpu_value_is_simply_kept_no_copy():
    """On a CPU-only machine the offload path runs, but keeps the very tensor the operator made."""
    made = []

    def policy(op, *args, **kwargs):
        return policies.Offload if op is aten.mm.default else False

    def fn(w1, w2, x):
        h = x @ w1
        made.append(h.detach())  # (remat refuses a stored tensor with a graph)
        return (h.tanh() @ w2).sum()

    r = remat(fn, policy=policy)
    w1 = W1.clone().requires_grad_()
    with _residuals._observe() as seen:
        out = r(w1, W2, X)
    saved = seen[0][0].saved
    kept = list(saved.kept.values())
    assert len(kept) == 2 and all(isinstance(k, torch.Tensor) for k in kept)
    assert kept[0].untyped_storage().data_ptr() == made[0].untyped_storage().data_ptr()  # no copy
    assert set(saved.offload) == set(saved.kept) and saved.previous is None  # nothing to prefetch
    out.backward()
    assert_close(w1.grad, tf.grad(lambda w: (X @ w).tanh().matmul(W2).sum())(W1))


# ------------------------------------------------------------------ the accelerator path, faked




@pytest.fixture
def fake(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setitem(_offload.BACKENDS, "cpu", backend)
    return backend


def test_fake_accelerator_copies_out_in_forward_and_back_with_prefetch_in_backward(fake):
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(4, n, dtype=D, generator=g) for n in (5, 6, 7)]
    ins = [torch.randn(n, 4, dtype=D, generator=g) for n in (5, 6, 7)]
    x = torch.randn(3, 4, dtype=D)

    def lay(w, v, h):
        return torch.sin(torch.tanh(h @ w) @ v)  # mm -> (3, n), then (3, 4): both inside the call

    f = remat(lay, policy=policies.offload_dot_with_no_batch_dims())

    def loss(ws, x, fn):
        h = x
        for w, v in zip(ws, ins):
            h = fn(w, v, h)
        return h.square().sum()

    leaves = [w.clone().requires_grad_() for w in ws]
    out = loss(leaves, x, f)
    forward_log = list(fake.log)
    # forward: every kept mm copied out, layer by layer, and nothing brought back yet
    assert [e[0] for e in forward_log] == ["to_host"] * 6
    assert [e[1] for e in forward_log] == [(3, 5), (3, 4), (3, 6), (3, 4), (3, 7), (3, 4)]
    assert all(e[2] is True for e in forward_log)  # pinned
    fake.log.clear()
    out.backward()
    kinds = [(e[0], e[1]) for e in fake.log]
    # backward, last layer first: its values come back and are waited for; then the layer before
    # it is prefetched (before that layer is recomputed), and waited for when it is.
    # backward, last layer first: its values come back and the compute stream is told to wait
    # for them; then the copies of the layer before it start (a prefetch, overlapping this
    # layer's recomputation and backward), and are waited for when that layer is recomputed.
    assert kinds == [
        ("to_device", (3, 7)), ("to_device", (3, 4)), ("ready", (3, 7)), ("ready", (3, 4)),
        ("to_device", (3, 6)), ("to_device", (3, 4)),  # prefetch of layer 2
        ("ready", (3, 6)), ("ready", (3, 4)),  # layer 2 recomputed: nothing to copy, only waits
        ("to_device", (3, 5)), ("to_device", (3, 4)),  # prefetch of layer 1
        ("ready", (3, 5)), ("ready", (3, 4)),
    ], kinds
    # each wait is on the mark of the copy back of that very tensor, which followed its copy out
    back = {e[3]: e for e in fake.log if e[0] == "to_device"}
    for e in fake.log:
        if e[0] == "ready":
            assert back[e[2]][1] == e[1]
    out_marks = {e[3] for e in forward_log}
    assert {e[2] for e in back.values()} == out_marks  # every copy back waited for its copy out
    ref = [w.clone().requires_grad_() for w in ws]
    loss(ref, x, lay).backward()
    assert_close([w.grad for w in leaves], [w.grad for w in ref])


def test_fake_accelerator_prefetches_one_call_ahead(fake):
    """Only the last call's copy back is started on demand; every other one by the call after it."""
    g = torch.Generator().manual_seed(8)
    ws = [torch.randn(4, 4, dtype=D, generator=g) for _ in range(3)]
    f = remat(lambda w, h: torch.tanh(h @ w), policy=policies.offload_dot_with_no_batch_dims())
    leaves = [w.clone().requires_grad_() for w in ws]
    h = torch.randn(2, 4, dtype=D)
    for w in leaves:
        h = f(w, h)
    fake.log.clear()
    h.sum().backward()
    kinds = [e[0] for e in fake.log]
    assert kinds == ["to_device", "ready", "to_device", "ready", "to_device", "ready"]


def test_fake_accelerator_under_func_grad_vmap_and_a_second_backward(fake):
    policy = policies.offload_dot_with_no_batch_dims()
    f, g = stack(block), stack(remat(block, policy=policy))
    assert_close(tf.grad(g, argnums=(0, 1))(W1, W2, X), tf.grad(f, argnums=(0, 1))(W1, W2, X))
    assert any(e[0] == "to_host" for e in fake.log) and any(e[0] == "ready" for e in fake.log)
    xs = torch.randn(2, 4, 6, dtype=D)
    assert_close(
        tf.vmap(tf.grad(g), in_dims=(None, None, 0))(W1, W2, xs), tf.vmap(tf.grad(f), in_dims=(None, None, 0))(W1, W2, xs)
    )
    a = W1.clone().requires_grad_()
    out = g(a, W2, X)
    out.backward(retain_graph=True)
    first = a.grad.clone()
    a.grad = None
    out.backward()  # the host copies are still there: brought back again
    assert_close(a.grad, first)
    a0 = W1.clone().requires_grad_()
    f(a0, W2, X).backward()
    assert_close(first, a0.grad)
    assert_close(tf.hessian(g, argnums=2)(W1, W2, X[:1]), tf.hessian(f, argnums=2)(W1, W2, X[:1]))


def test_fake_accelerator_reports_host_copies_and_drops_device_tensors(fake):
    policy = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["hidden"], names_which_can_be_offloaded=["out"], offload_dst="unpinned_host"
    )
    rs = funckpt.saved_residuals(remat(block, policy=policy), W1, W2, X)
    assert [(r.source, r.offloaded) for r in rs if r.kind == "saved by policy"] == [
        ("aten.tanh.default named 'hidden'", False),
        ("aten.mm.default named 'out'", True),
    ]
    assert [e[2] for e in fake.log if e[0] == "to_host"] == [False]  # unpinned, as asked


def test_an_offloaded_value_modified_in_the_forward_run_is_recomputed_not_copied(fake):
    def fn(w, x):
        h = x @ w
        h.mul_(2)  # the kept value changed after its operator made it
        return h.tanh().sum()

    r = remat(fn, policy=policies.offload_dot_with_no_batch_dims())
    w = W1[:, :6].clone().requires_grad_()
    r(w, X).backward()
    assert not any(e[0] == "to_host" for e in fake.log)
    w0 = W1[:, :6].clone().requires_grad_()
    fn(w0, X).backward()
    assert_close(w.grad, w0.grad)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (lambda: policies.offload_dot_with_no_batch_dims(offload_src="host"), ValueError, "offload_src"),
        (lambda: policies.offload_dot_with_no_batch_dims(offload_dst="disk"), ValueError, "offload_dst"),
        (lambda: policies.offload_dot_with_no_batch_dims(offload_dst=None), TypeError, "offload_dst"),
        (lambda: policies.offload_dot_with_no_batch_dims(offload_src=0), TypeError, "offload_src"),
        (
            lambda: policies.save_and_offload_only_these_names(offload_dst="gpu"),
            ValueError,
            "offload_dst",
        ),
        (
            lambda: policies.save_and_offload_only_these_names(names_which_can_be_saved="ab"),
            TypeError,
            "names_which_can_be_saved",
        ),
        (
            lambda: policies.save_and_offload_only_these_names(names_which_can_be_offloaded=[1]),
            TypeError,
            "names_which_can_be_offloaded",
        ),
        (
            lambda: policies.save_and_offload_only_these_names(
                names_which_can_be_saved=["a", "b"], names_which_can_be_offloaded=["b"]
            ),
            ValueError,
            r"must not share names.*\['b'\]",
        ),
        (lambda: policies.Offloadable("host", "pinned_host"), ValueError, "src"),
    ],
)
def test_bad_offload_arguments_name_the_argument(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_offload_factories_must_be_called():
    with pytest.raises(TypeError, match=r"policy=policies.offload_dot_with_no_batch_dims\(...\)"):
        remat(block, policy=policies.offload_dot_with_no_batch_dims)


def test_an_output_of_the_call_is_kept_in_place_not_offloaded(fake):
    """The caller holds it on the device anyway; and a write to it makes the recomputation run
    its operator again, as for any kept value."""
    f = remat(lambda w, x: x @ w, policy=policies.offload_dot_with_no_batch_dims())
    rs = funckpt.saved_residuals(f, W1, X)
    assert [(r.source, r.offloaded) for r in rs if r.kind == "saved by policy"] == [("aten.mm.default", False)]
    assert fake.log == []
    w = W1.clone().requires_grad_()
    y = f(w, X)
    y.add_(1)
    y.square().sum().backward()
    assert_close(w.grad, torch.func.grad(lambda w: ((X @ w) + 1).square().sum())(W1))


# ------------------------------------------------------------------ the CUDA backend's code, on fake streams


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.id))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream API recorded instead of run, so _CudaBackend's own code runs on the CPU."""
    import contextlib

    log = []
    main = _Stream("main", log)
    state = {"current": main, "events": 0}

    class Event:
        def __init__(self):
            state["events"] += 1
            self.id = state["events"]

        def record(self, stream):
            log.append(("record", stream.name, self.id))

    @contextlib.contextmanager
    def stream(s):
        before, state["current"] = state["current"], s
        log.append(("enter", s.name))
        try:
            yield
        finally:
            state["current"] = before
            log.append(("exit", s.name))

    def copy_(self, src, non_blocking=False):
        log.append(("copy", state["current"].name, non_blocking))
        return original_copy(self, src, non_blocking=non_blocking)

    original_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("side", log))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s.name)), raising=False)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return log


def test_cuda_backend_orders_copies_with_streams_and_events(fake_cuda):
    backend = _offload._CudaBackend()
    t = torch.randn(3, 4, dtype=D)
    host, out_done = backend.to_host(t, pinned=False)  # pinned needs a CUDA build; the order is the same
    assert fake_cuda == [
        ("wait_stream", "side", "main"),  # the side stream starts after t was computed
        ("enter", "side"),
        ("copy", "side", False),  # the copy runs on the side stream
        ("record", "side", 1),  # marked done there
        ("exit", "side"),
        ("record_stream", "side"),  # t's memory is not reused before the side stream read it
    ]
    assert torch.equal(host, t) and host is not t
    fake_cuda.clear()
    back, back_done = backend.to_device(host, torch.device("cpu"), out_done)
    backend.ready(back, back_done)
    assert fake_cuda == [
        ("enter", "side"),
        ("wait_event", "side", 1),  # after the copy out
        ("copy", "side", False),
        ("record", "side", 2),
        ("exit", "side"),
        ("wait_event", "main", 2),  # the compute stream waits for the copy back, not for everything
        ("record_stream", "main"),  # allocated on the side stream, used and freed on the compute one
    ]
    assert torch.equal(back, t)


def test_cuda_backend_through_a_whole_backward(fake_cuda, monkeypatch):
    monkeypatch.setitem(_offload.BACKENDS, "cpu", _offload._CudaBackend())
    policy = policies.offload_dot_with_no_batch_dims(offload_dst="unpinned_host")
    f, g = stack(block), stack(remat(block, policy=policy))
    a, a0 = W1.clone().requires_grad_(), W1.clone().requires_grad_()
    g(a, W2, X).backward()
    f(a0, W2, X).backward()
    assert_close(a.grad, a0.grad)
    records = [e for e in fake_cuda if e[0] == "record"]
    waits = [e for e in fake_cuda if e[0] == "wait_event" and e[1] == "main"]
    assert len(records) == 12 and len(waits) == 6  # 3 calls, 2 matmuls each: out and back; a wait per value
    assert_close(tf.grad(g)(W1, W2, X), tf.grad(f)(W1, W2, X))


def test_offloading_and_budget_policies_are_not_lowered_to_the_compilers_region():
    """torch.compile's checkpoint region only saves or recomputes: those calls run eagerly there."""
    from funckpt._compile import can_lower
    from funckpt._options import RematOptions

    def lowered(policy):
        return can_lower(RematOptions(policy=policy))

    assert lowered(policies.dots_saveable) and lowered(policies.from_torch([aten.mm]))
    assert not lowered(policies.offload_dot_with_no_batch_dims())
    assert not lowered(policies.save_and_offload_only_these_names(names_which_can_be_offloaded=["x"]))
    assert not lowered(policies.save_from_both_policies(policies.dots_saveable, policies.offload_dot_with_no_batch_dims()))
    assert not lowered(policies.memory_budget(0.5))
    assert lowered(policies.memory_budget(1.0))  # that is everything_saveable


def test_offload_under_torch_compile_gives_eager_gradients():
    g = stack(remat(block, policy=policies.offload_dot_with_no_batch_dims()))
    compiled = torch.compile(g, backend="aot_eager")
    a, a0 = W1.clone().requires_grad_(), W1.clone().requires_grad_()
    compiled(a, W2, X).backward()
    stack(block)(a0, W2, X).backward()
    assert_close(a.grad, a0.grad)


def test_fake_accelerator_prefetches_only_calls_of_the_same_thread(fake):
    """A thread's backward prefetches the call before in its own forward pass, never a call that
    another thread (a DataParallel replica) made meanwhile: that would bring the other thread's
    values back long before its own backward needs them."""
    import threading

    f = remat(lambda w, h: torch.tanh(h @ w), policy=policies.offload_dot_with_no_batch_dims())
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    other: list = []

    def other_thread():
        other.append(f(torch.randn(4, 2, dtype=D, requires_grad=True), torch.randn(5, 4, dtype=D)))  # a (5, 2) value

    h = f(w, torch.randn(2, 4, dtype=D))
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    h = f(w, h)
    fake.log.clear()
    h.sum().backward()
    assert [(e[0], e[1]) for e in fake.log] == [
        ("to_device", (2, 4)), ("ready", (2, 4)),  # the last call, on demand
        ("to_device", (2, 4)), ("ready", (2, 4)),  # the call before it in this thread, prefetched
    ]
    assert other[0].grad_fn is not None  # (the other thread's call was alive all along)
