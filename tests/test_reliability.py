"""No leaks across steps, and concurrent use from several threads."""

import threading

import pytest

import torch
import torch.func as tf
from torch.testing import assert_close

from benchmarks._common import held_bytes
from funckpt import CheckpointError, policies, remat

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


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: tf.grad(loss(remat(block)))(WS, X), id="remat-torch.func.grad"),
        pytest.param(lambda: loss(remat(block, policy=policies.dots_saveable))(_leaves(), X).backward(), id="remat-backward"),
        pytest.param(lambda: tf.grad(lambda w: _scan_loss(w, None))(WS[0]), id="scan-torch.func.grad"),
        pytest.param(lambda: _scan_loss(WS[0].clone().requires_grad_(), 2).backward(), id="scan-checkpoints-backward"),
    ],
)
def test_no_reference_cycles_keep_funckpt_objects_alive(call):
    """Reference counting alone frees what a call keeps (kept values, a loop's carries): never the GC."""
    import gc

    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        call()
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("funckpt")]
        tensors = sum(isinstance(o, torch.Tensor) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [] and tensors == 0


def _leaves() -> list:
    return [w.clone().requires_grad_() for w in WS]


def _scan_loss(w, checkpoints):
    from funckpt import scan

    carry, _ = scan(lambda c, _: (block(w, c), None), X, None, length=5, checkpoints=checkpoints)
    return carry.square().mean()


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


class _Block(torch.nn.Module):
    """A pre-norm GPT block: LayerNorm, causal SDPA with dropout, an MLP with dropout."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


def _train_stack(use_remat: bool, steps: int, functional: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block() for _ in range(3))
    stack = torch.nn.ModuleList(remat(b) for b in blocks) if use_remat else blocks
    data = torch.randn(steps, 2, 8, 16)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-3)
    params = dict(stack.named_parameters())

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return tf.functional_call(stack, p, (x,), strict=True).pow(2).mean()

    stack.forward = lambda x: _chain_layers(stack, x)  # type: ignore[method-assign]
    for i in range(steps):
        opt.zero_grad()
        if functional:
            grads = tf.grad(loss_fn)({k: v.detach() for k, v in params.items()}, data[i])
            for k, p in params.items():
                p.grad = grads[k]
        else:
            stack(data[i]).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in stack.parameters()]


def _chain_layers(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("functional, steps", [(False, 300), (True, 100)], ids=["backward", "torch_func_grad"])
def test_stress_transformer_stack_with_default_options_never_raises(functional, steps):
    """Hundreds of training steps of a dropout transformer stack with every block remat'd
    (default options: the determinism check on): no alarm, and the same parameters as
    training without remat (dropout replays exactly)."""
    assert_close(_train_stack(True, steps, functional), _train_stack(False, steps, functional))


class _Pausing(torch.nn.Module):
    """A linear layer whose forward calls its thread's ``pause`` (if any) before or after reading its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.pauses = threading.local()

    def forward(self, x):
        getattr(self.pauses, "before", lambda: None)()
        y = torch.tanh(self.lin(x))
        getattr(self.pauses, "after", lambda: None)()
        return y


def _same_module_in_two_threads(a_pauses: str, b_does: str):
    """Thread A calls ``remat(module)`` and pauses inside its run (``a_pauses``: before or after
    reading the weight) while thread B calls it too, or differentiates a call made before (its
    recomputation runs the module), pausing inside its run until A has left: the runs interleave,
    A leaving first. Events, not timing, order them. Returns each thread's result or error."""
    module = _Pausing()
    params = dict(module.named_parameters())
    step = remat(module)
    weight = module.lin.weight  # (not read while a thread runs the module: that reads its stand-in)
    xa, xb = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    b_earlier = step(xb).square().sum()
    a_inside, b_reached, a_left = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def wait(event):
        assert event.wait(timeout=30)

    def a():
        module.pauses.__dict__[a_pauses] = lambda: (a_inside.set(), wait(b_reached))
        try:
            outcome["a"] = torch.autograd.grad(step(xa).square().sum(), weight)[0]
        except CheckpointError as e:
            outcome["a"] = e
        finally:
            a_left.set()

    def b():
        module.pauses.after = lambda: (b_reached.set(), wait(a_left))
        try:
            y = step(xb).square().sum() if b_does == "call" else b_earlier
            outcome["b"] = torch.autograd.grad(y, weight)[0]
        except CheckpointError as e:
            outcome["b"] = e
        finally:
            b_reached.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    threads[0].start()
    wait(a_inside)
    threads[1].start()
    for t in threads:
        t.join()
    assert dict(module.named_parameters()) == params and all(type(p) is torch.nn.Parameter for p in params.values())
    for name, x in zip("ab", (xa, xb)):
        if isinstance(outcome[name], torch.Tensor):
            assert_close(outcome[name], torch.autograd.grad(module(x).square().sum(), weight)[0])
    return {name: type(o).__name__ if isinstance(o, torch.Tensor) else str(o) for name, o in outcome.items()}


@pytest.mark.parametrize("a_pauses", ["before", "after"])
@pytest.mark.parametrize("b_does", ["call", "backward"])
def test_same_module_in_two_threads_raises_or_is_right_and_leaves_its_parameters_as_they_were(a_pauses, b_does):
    """Not supported (each thread needs its own copy of a module), but never silently wrong. The
    run that left first used to put back what it found, the other run's stand-ins, and the module
    held them for good (an optimizer then updated parameters the module no longer used); a call
    in B took A's stand-in for the weight, so its gradient went there, silently missing. Now a
    thread that would use the other's stand-in raises saying why, the other one's gradient is
    right, and the module ends with its own parameters."""
    outcome = _same_module_in_two_threads(a_pauses, b_does)
    same_module = "two threads ran the same module"
    if b_does == "call":  # B's call finds A's stand-in in the module
        assert outcome["a"] == "Tensor" and same_module in outcome["b"]
    elif a_pauses == "before":  # A reads the weight while B's recomputation has its stand-in there
        assert same_module in outcome["a"] and outcome["b"] == "Tensor"
    else:  # each read its own stand-in: both right
        assert outcome == {"a": "Tensor", "b": "Tensor"}


def test_two_threads_running_their_own_modules_that_share_a_buffer():
    """Two models sharing a tensor that no gradient flows into (a mask, a frozen embedding
    registered on both), run by two threads at once: each run leaves that tensor itself in its
    module's place, no stand-in, and the other thread reaches it rightly (it raised 'two threads
    ran the same module')."""

    class Scaled(_Pausing):
        def forward(self, x):
            return super().forward(x) * self.scale

    shared = torch.randn(4, dtype=D)
    modules = [Scaled(), Scaled()]
    for m in modules:
        m.register_buffer("scale", shared)
    xs = [torch.randn(3, 4, dtype=D) for _ in modules]
    a_inside, b_left = threading.Event(), threading.Event()
    outcome: dict[int, object] = {}

    def run(i):
        if i == 0:  # (A pauses inside its run until B has left)
            modules[0].pauses.before = lambda: (a_inside.set(), b_left.wait(timeout=30))
        try:
            outcome[i] = torch.autograd.grad(remat(modules[i])(xs[i]).square().sum(), modules[i].lin.weight)[0]
        except CheckpointError as e:
            outcome[i] = e
        finally:
            if i == 1:
                b_left.set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    threads[0].start()
    assert a_inside.wait(timeout=30)
    threads[1].start()
    for t in threads:
        t.join()
    for i, m in enumerate(modules):
        assert isinstance(outcome[i], torch.Tensor), outcome[i]
        assert_close(outcome[i], torch.autograd.grad(m(xs[i]).square().sum(), m.lin.weight)[0])
