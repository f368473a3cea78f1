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
