"""funckpt on torchvision's classification models: third-party code nobody here wrote.

torchvision has no gradient checkpointing of its own (DenseNet's ``memory_efficient``
layers aside, which call ``torch.utils.checkpoint.checkpoint``: routed to funckpt), so
its blocks are remat'd in place: ViT's encoder blocks, Swin's (v1 and v2: shifted windows,
relative position bias, attention masks built in the forward pass), ConvNeXt's (layer
scale), MaxViT's (MBConv with BatchNorm, block and grid attention), EfficientNet's MBConv
(squeeze-excitation) and RegNet's. Stochastic depth (``torchvision.ops.stochastic_depth``:
a ``bernoulli_`` on a fresh tensor), dropout and attention dropout are on; BatchNorm runs in
training mode and its running statistics must be stepped once. Every model is built from a
tiny configuration with random weights (nothing downloaded), in float64, and compared with
the same model without remat under ``.backward()``, ``torch.func.grad`` through
``functional_call``, per-example ``vmap(grad)`` (eval mode) and, for the models without
BatchNorm, ``vmap(grad)`` in training mode with ``randomness="same"``. (``"different"``
fails without remat too: stochastic depth draws in place into a tensor vmap does not batch.)

torchvision is missing from the main CI venv: there this file skips.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

torchvision = pytest.importorskip("torchvision")

import torch  # noqa: E402
import torch.func as tf  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from torchvision.models import convnext, maxvit, swin_transformer, vision_transformer  # noqa: E402

import funckpt  # noqa: E402

D = torch.float64
LABELS = torch.tensor([0, 2])

MODELS: dict[str, Callable[[], nn.Module]] = {
    "vit": lambda: vision_transformer.VisionTransformer(
        32, 8, 2, 2, 32, 64, dropout=0.1, attention_dropout=0.1, num_classes=3
    ),
    "swin": lambda: swin_transformer.SwinTransformer(
        [4, 4], 16, [1, 1], [1, 2], [4, 4], stochastic_depth_prob=0.2, dropout=0.1, attention_dropout=0.1,
        num_classes=3,
    ),
    "swin_v2": lambda: swin_transformer.SwinTransformer(
        [4, 4], 16, [1, 1], [1, 2], [4, 4], stochastic_depth_prob=0.2, num_classes=3,
        block=swin_transformer.SwinTransformerBlockV2, downsample_layer=swin_transformer.PatchMergingV2,
    ),
    "convnext": lambda: convnext.ConvNeXt(
        [convnext.CNBlockConfig(8, 16, 1), convnext.CNBlockConfig(16, None, 1)], stochastic_depth_prob=0.2,
        num_classes=3,
    ),
    "maxvit": lambda: maxvit.MaxVit(
        input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[8, 16], block_layers=[1, 1],
        head_dim=4, stochastic_depth_prob=0.2, num_classes=3,
    ),
    "efficientnet": lambda: torchvision.models.efficientnet_b0(num_classes=3, stochastic_depth_prob=0.2),
    "regnet": lambda: torchvision.models.regnet_x_400mf(num_classes=3),
}
BATCHNORM = {"maxvit", "efficientnet", "regnet"}
BLOCKS = (
    "EncoderBlock", "SwinTransformerBlock", "SwinTransformerBlockV2", "CNBlock", "MaxVitLayer", "MBConv",
    "ResBottleneckBlock",
)


def _perturb(model: nn.Module) -> nn.Module:
    """Noise on every parameter (torchvision zero-initialises some heads and biases)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=g))
    return model


def build(name: str, *, train: bool = True) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _perturb(MODELS[name]().to(D)).train(train)
    return model, torch.randn(2, 3, 32, 32, dtype=D, generator=torch.Generator().manual_seed(1))


def remat_blocks(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each of its blocks replaced by ``funckpt.remat(block)``."""
    model = copy.deepcopy(model)
    found = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in BLOCKS
    ]
    assert found, type(model).__name__
    for parent, name in found:
        setattr(parent, name, funckpt.remat(getattr(parent, name)))
    return model


def _loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, LABELS)


def backward_results(model: nn.Module, x: torch.Tensor, seed: int = 5) -> dict:
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = model(x)
    _loss(out).backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "x.grad": x.grad,
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
    }


def func_grad_results(model: nn.Module, x: torch.Tensor, seed: int = 5) -> dict:
    """torch.func.grad w.r.t. the parameters and the input (the buffers an argument: BatchNorm
    writes them in place in training mode)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def loss(params, buffers, x):
        return _loss(tf.functional_call(model, (params, buffers), (x,)))

    torch.manual_seed(seed)
    return {"grads": tf.grad(loss, argnums=(0, 2))(params, buffers, x), "buffers": buffers}


def per_example_grads(model: nn.Module, x: torch.Tensor, randomness: str = "error") -> dict:
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(params, xi, yi):
        return F.cross_entropy(tf.functional_call(model, (params, buffers), (xi[None],)), yi[None])

    torch.manual_seed(5)
    return tf.vmap(tf.grad(loss), in_dims=(None, 0, 0), randomness=randomness)(params, x, LABELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_remat_blocks_backward(name):
    reference, x = build(name)
    model = remat_blocks(reference)
    for seed in (5, 6):  # (two seeds: two stochastic-depth draws)
        assert_close(backward_results(model, x, seed), backward_results(reference, x, seed))
        model.zero_grad()
        reference.zero_grad()
    if name in BATCHNORM:
        counters = [int(v) for k, v in model.named_buffers() if k.endswith("num_batches_tracked")]
        assert counters and all(c == 2 for c in counters), counters  # once per forward pass


@pytest.mark.parametrize("name", list(MODELS))
def test_remat_blocks_torch_func_grad(name):
    reference, x = build(name)
    assert_close(func_grad_results(remat_blocks(reference), x), func_grad_results(reference, x))


@pytest.mark.parametrize("name", ["vit", "swin", "convnext", "maxvit", "efficientnet"])
def test_vmap_grad_per_example_eval_mode(name):
    reference, x = build(name, train=False)
    assert_close(per_example_grads(remat_blocks(reference), x), per_example_grads(reference, x))


@pytest.mark.parametrize("name", ["vit", "swin", "swin_v2", "convnext"])
def test_vmap_grad_per_example_train_mode_same_randomness(name):
    reference, x = build(name)
    assert_close(per_example_grads(remat_blocks(reference), x, "same"), per_example_grads(reference, x, "same"))


def test_vmap_grad_per_example_train_mode_different_randomness_vit():
    """ViT's dropout draws per example under ``randomness="different"``, as without remat."""
    reference, x = build("vit")
    assert_close(
        per_example_grads(remat_blocks(reference), x, "different"), per_example_grads(reference, x, "different")
    )


def test_densenet_memory_efficient(routed):
    """DenseNet's ``memory_efficient`` layers checkpoint a closure over their list of feature maps
    (``cp.checkpoint(closure, *prev_features, use_reentrant=False)``), routed to funckpt, against
    ``memory_efficient=False``; BatchNorm in training mode."""

    def make(memory_efficient):
        torch.manual_seed(0)
        return _perturb(
            torchvision.models.DenseNet(
                growth_rate=4, block_config=(1, 2), num_init_features=8, bn_size=2, num_classes=3,
                memory_efficient=memory_efficient,
            ).to(D)
        ).train()

    reference, model = make(False), make(True)
    x = build("vit")[1]
    assert_close(backward_results(model, x), backward_results(reference, x))
    assert routed
    assert_close(func_grad_results(model, x), func_grad_results(reference, x))
