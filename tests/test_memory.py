"""Between forward and backward, remat keeps only inputs, under torch.func.grad too.

Byte counts from the profiler's memory events: deterministic, not timings.
"""

import torch
import torch.func as tf

from benchmarks._common import held_bytes, peak_bytes
from benchmarks.mlp_stack import block, init_params, loss_fn
from funckpt import remat

PARAMS = init_params(depth=6, width=64)
X = torch.randn(256, 64)


def test_remat_under_torch_func_grad_saves_memory():
    plain = peak_bytes(lambda: tf.grad(loss_fn)(PARAMS, X))
    rematted = peak_bytes(lambda: tf.grad(loss_fn)(PARAMS, X, remat(block)))
    assert rematted < 0.4 * plain, (rematted, plain)


def test_remat_under_vmap_of_grad_saves_memory():
    xs = X.reshape(4, 64, 64)

    def per_example_grads(block_fn):
        return tf.vmap(tf.grad(lambda p, x: loss_fn(p, x, block_fn)), in_dims=(None, 0))(PARAMS, xs)

    plain = peak_bytes(lambda: per_example_grads(block))
    rematted = peak_bytes(lambda: per_example_grads(remat(block)))
    assert rematted < 0.6 * plain, (rematted, plain)


def test_remat_with_backward_saves_memory():
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in PARAMS]

    def clear():
        for p in leaves:
            for v in p.values():
                v.grad = None

    def step(block_fn):
        loss_fn(leaves, X, block_fn).backward()
        return [v.grad for p in leaves for v in p.values()]

    plain = peak_bytes(lambda: step(block), setup=clear)
    rematted = peak_bytes(lambda: step(remat(block)), setup=clear)
    assert rematted < 0.75 * plain, (rematted, plain)


def test_between_forward_and_backward_vjp_keeps_only_block_inputs():
    def forward(block_fn):
        return tf.vjp(lambda p: loss_fn(p, X, block_fn), PARAMS)

    plain = held_bytes(lambda: forward(block))
    rematted = held_bytes(lambda: forward(remat(block)))
    activation = X.numel() * X.element_size()
    rng_state = torch.get_rng_state().numel()  # each remat'd call keeps the CPU generator's state
    # Six blocks: the inputs of blocks 2..6 (block 1's is X, allocated before),
    # the last output (saved by the loss's square), and six RNG states.
    assert rematted <= 6 * activation + 6 * rng_state + 1024, (rematted, activation)
    assert rematted < 0.2 * plain


def test_backward_peak_grows_with_depth_as_torch_checkpoints_does():
    """During the backward pass each block's input is freed after its own backward, as under
    torch.utils.checkpoint: a reference to it from the Function's context (which lives as long as
    the caller's graph) kept one activation per block until the end, past its use."""
    from torch.utils.checkpoint import checkpoint

    def peak(depth, block_fn):
        params = init_params(depth=depth, width=64)
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
        return peak_bytes(lambda: loss_fn(leaves, X, block_fn).backward())

    def torch_block(p, x):
        return checkpoint(block, p, x, use_reentrant=False)

    per_block_remat = (peak(8, remat(block)) - peak(4, remat(block))) / 4
    per_block_torch = (peak(8, torch_block) - peak(4, torch_block)) / 4
    activation = X.numel() * X.element_size()
    assert per_block_remat <= per_block_torch + 0.1 * activation, (per_block_remat, per_block_torch, activation)


def _torch_checkpointed(fn):
    from torch.utils.checkpoint import checkpoint

    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


def _block_plus(p, x, a):
    return block(p, x) + a


def _per_block_reached_through_partial(depth, wrap, keep_loss):
    """A stack whose blocks each reach a tensor of their own (an activation computed outside the
    block, ``a = x * 2``, which nothing else saves) through ``functools.partial``."""
    import functools

    params = init_params(depth=depth, width=64)
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]

    def step():
        x = X
        for p in leaves:
            x = wrap(functools.partial(_block_plus, a=x * 2.0))(p, x)
        loss = x.square().mean()
        loss.backward()
        return loss if keep_loss else None

    measure = held_bytes if keep_loss else peak_bytes
    return measure(step)


def test_tensor_reached_through_a_partial_is_freed_after_its_blocks_backward():
    """As under torch.utils.checkpoint, a tensor the block reaches through its closure or a
    ``functools.partial`` is freed once that block's backward has run. The Function's context
    (alive as long as the caller's graph) kept the region, and the region the function and the
    tensors it captured: one activation per block stayed alive through the whole backward."""
    activation = X.numel() * X.element_size()

    def slope(wrap, keep_loss):
        return (
            _per_block_reached_through_partial(8, wrap, keep_loss) - _per_block_reached_through_partial(4, wrap, keep_loss)
        ) / 4

    per_block_remat = slope(remat, keep_loss=False)
    per_block_torch = slope(_torch_checkpointed, keep_loss=False)
    assert per_block_remat <= per_block_torch + 0.1 * activation, (per_block_remat, per_block_torch, activation)


def test_after_the_backward_the_callers_graph_holds_what_torch_checkpoints_would():
    """The loss kept after ``.backward()`` (for logging, say) keeps the graph's nodes alive; their
    saved tensors are freed, and so must be everything else a remat'd call kept for its backward
    (the captured tensors, the function). Each call's CPU generator state may stay (5 KB)."""
    activation = X.numel() * X.element_size()
    rng_state = torch.get_rng_state().numel()
    depth = 6
    rematted = _per_block_reached_through_partial(depth, remat, keep_loss=True)
    torch_held = _per_block_reached_through_partial(depth, _torch_checkpointed, keep_loss=True)
    assert rematted <= torch_held + depth * rng_state + 0.1 * activation, (rematted, torch_held, activation)
