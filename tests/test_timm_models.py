"""funckpt on timm's models: third-party vision code nobody on this project wrote.

Every model is built by timm from a tiny configuration with random weights
(``pretrained=False``: nothing is downloaded), in float64, and every result is
compared with the same model run without checkpointing. Three ways in:

- timm's own gradient checkpointing (``model.set_grad_checkpointing(True)``), whose
  ``checkpoint``/``checkpoint_seq`` helpers (``timm.models._manipulate``) call
  ``torch.utils.checkpoint.checkpoint``: that one name is routed to
  ``funckpt.checkpoint``, and the tests check it was called;
- ``funckpt.remat(block)`` put in place of each block of ``model.blocks``,
  ``model.stages`` or ``model.layerN``;
- both under ``torch.func`` (``grad``, ``vmap(grad)``, ``jacrev``, ``jvp``,
  ``jacfwd``) through ``functional_call``.

BatchNorm runs in training mode wherever torch allows it: its running statistics
must end up as without checkpointing (README: remat updates buffers once per
forward pass; the recomputation updates a copy). Dropout and drop-path are on in
the transformer and ConvNeXt configurations: the recomputation must replay the
forward pass's masks, so gradients equal the un-checkpointed model's under the
same seed.

timm needs torchvision; where it is missing (the main CI venv) this file skips.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
timm = pytest.importorskip("timm")

import torch  # noqa: E402
import torch.func as tf  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch.testing import assert_close  # noqa: E402

import funckpt  # noqa: E402
from funckpt import policies  # noqa: E402

D = torch.float64
_TORCH_CHECKPOINT = torch.utils.checkpoint.checkpoint
LABELS = torch.tensor([0, 2])

pytestmark = [
    # torch's note that vmap falls back to a loop for CPU flash attention
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# ---------------------------------------------------------------------------
# The models: tiny configurations, the input resolution each needs.
# ---------------------------------------------------------------------------

_DROP = dict(drop_rate=0.1, drop_path_rate=0.2, proj_drop_rate=0.1, attn_drop_rate=0.1)

MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    # ResNet: BatchNorm (train mode), ReLU(inplace=True), checkpoint_seq(flatten=True) over layer1-4
    "resnet": (lambda: timm.create_model("test_resnet", num_classes=3), 32),
    # ResNet with DropBlock (random, torch.rand-based) and stochastic depth
    "resnet_dropblock": (
        lambda: timm.create_model("test_resnet", num_classes=3, drop_block_rate=0.2, drop_path_rate=0.2), 32
    ),
    # ConvNeXt: LayerNorm2d, layer scale, drop_path
    "convnext": (lambda: timm.create_model("test_convnext", num_classes=3, drop_path_rate=0.2), 32),
    # ViT: fused attention with attention dropout, drop_path, dropout, checkpoint_seq over blocks
    "vit": (lambda: timm.create_model("test_vit", num_classes=3, **_DROP), 32),
    # ViT with register tokens, attention-pool head, layer scale, qk-norm, manual attention path
    "vit_map_qknorm": (
        lambda: _unfused(
            timm.models.vision_transformer.VisionTransformer(
                img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3, reg_tokens=2,
                global_pool="map", init_values=1e-2, qk_norm=True, **_DROP,
            )
        ),
        32,
    ),
    # DeiT distilled: two heads
    "deit_distilled": (
        lambda: timm.create_model(
            "deit_tiny_distilled_patch16_224", num_classes=3, img_size=32, patch_size=8, depth=2, **_DROP
        ),
        32,
    ),
    # ViT with relative position bias shared across blocks (passed as checkpoint(blk, x, shared_rel_pos=...))
    "vit_relpos_shared": (
        lambda: timm.models.vision_transformer_relpos.VisionTransformerRelPos(
            img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3, shared_rel_pos=True,
            drop_path_rate=0.2,
        ),
        32,
    ),
    # EVA-02: rotary embeddings (buffers), SwiGLU, checkpoint(blk, x, rope=rope)
    "eva02": (
        lambda: timm.create_model(
            "eva02_tiny_patch14_224", num_classes=3, img_size=28, patch_size=7, depth=2, embed_dim=32, num_heads=2,
            drop_path_rate=0.2,
        ),
        28,
    ),
    # BEiT: relative position bias index buffers
    "beit": (
        lambda: timm.create_model(
            "beit_base_patch16_224", num_classes=3, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2,
            drop_path_rate=0.2,
        ),
        32,
    ),
    # EfficientNet: depthwise conv, squeeze-excite, BatchNormAct2d, drop_path
    "efficientnet": (lambda: timm.create_model("test_efficientnet", num_classes=3, drop_path_rate=0.2), 32),
    # MobileNetV3: hard-swish, hard-sigmoid SE, BatchNorm
    "mobilenetv3": (lambda: timm.create_model("mobilenetv3_small_050", num_classes=3), 32),
    # Swin: window attention, relative position bias, torch.roll shifts, attention masks as buffers
    "swin": (
        lambda: timm.create_model(
            "swin_tiny_patch4_window7_224", num_classes=3, img_size=32, patch_size=4, window_size=4, embed_dim=16,
            depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.2,
        ),
        32,
    ),
    # MaxViT: block and grid attention, relative position bias, BatchNorm in the MBConv
    "maxvit": (lambda: timm.create_model("test_maxvit", num_classes=3, img_size=64), 64),
    # CoAtNet: conv and transformer stages
    "coatnet": (lambda: timm.create_model("test_coatnet", num_classes=3, img_size=64), 64),
    # MLP-Mixer and ResMLP (Affine norm)
    "mixer": (
        lambda: timm.models.mlp_mixer.MlpMixer(
            num_classes=3, img_size=32, patch_size=8, num_blocks=2, embed_dim=32, drop_path_rate=0.2
        ),
        32,
    ),
    "resmlp": (
        lambda: timm.models.mlp_mixer.MlpMixer(
            num_classes=3, img_size=32, patch_size=8, num_blocks=2, embed_dim=32, mlp_ratio=4,
            block_layer=timm.models.mlp_mixer.ResBlock, norm_layer=timm.models.mlp_mixer.Affine,
        ),
        32,
    ),
    # NFNet: scaled weight-standardized convs (the weight is transformed inside the region)
    "nfnet": (lambda: timm.create_model("test_nfnet", num_classes=3), 32),
    # TNT: a checkpointed block with two inputs and two outputs
    "tnt": (
        lambda: timm.models.tnt.TNT(
            img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_outer=2, num_heads_inner=2,
            first_stride=2, num_classes=3, drop_path_rate=0.2,
        ),
        32,
    ),
    # Qwen3 vision tower: 2D rope passed into each checkpointed block
    "qwen3_vit": (
        lambda: timm.create_model(
            "qwen3_vit_88m", num_classes=3, embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8,
            pos_embed_grid_size=4, drop_path_rate=0.2,
        ),
        32,
    ),
    # PVT-v2: checkpoint(blk, x, feat_size) with non-tensor arguments
    "pvt_v2": (
        lambda: timm.models.pvt_v2.PyramidVisionTransformerV2(
            depths=(1, 1, 1, 1), embed_dims=(8, 16, 32, 64), num_heads=(1, 1, 2, 2), num_classes=3,
            drop_path_rate=0.2,
        ),
        32,
    ),
}

# Those with BatchNorm in training mode (running statistics updated in the forward pass)
BATCHNORM = {"resnet", "resnet_dropblock", "efficientnet", "mobilenetv3", "maxvit", "coatnet"}
# Those whose output changes with the seed in training mode (dropout, drop_path, DropBlock);
# test_randomness_is_on_and_replayed checks it for some
RANDOM = {
    "resnet_dropblock", "convnext", "vit", "vit_map_qknorm", "deit_distilled", "vit_relpos_shared", "eva02",
    "beit", "swin", "mixer", "tnt", "qwen3_vit", "pvt_v2",
}


def _unfused(model: nn.Module) -> nn.Module:
    """timm's manual attention path (softmax(q k^T) v) instead of scaled_dot_product_attention."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


def _perturb(model: nn.Module) -> nn.Module:
    """Add noise to every parameter.

    timm zero-initializes parts of many models (the last BatchNorm's weight in each ResNet
    block, NFNet's skip-init gains, the MLP-Mixer head) and scales others by 1e-6 (ConvNeXt's
    layer scale): there most gradients are exactly zero (or the residual branch invisible, and
    so is a wrong dropout mask), and a comparison of them proves nothing."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=g))
    return model


def build(name: str, *, train: bool = True) -> tuple[nn.Module, torch.Tensor]:
    """The model (float64, seeded, perturbed) and an input batch of two images."""
    make, res = MODELS[name]
    torch.manual_seed(0)
    model = _perturb(make().to(D)).train(train)
    x = torch.randn(2, 3, res, res, dtype=D, generator=torch.Generator().manual_seed(1))
    return model, x


def blocks_of(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(container, index) of each block: model.layer1-4, model.blocks or model.stages."""
    if hasattr(model, "layer1"):
        seqs = [getattr(model, f"layer{i}") for i in range(1, 5)]
    else:
        seqs = [
            getattr(model, n) for n in ("blocks", "stages", "layers") if isinstance(getattr(model, n, None), nn.Sequential)
        ]
    assert seqs, f"no block list found in {type(model).__name__}"
    return [(seq, str(i)) for seq in seqs for i in range(len(seq))]


def remat_blocks(model: nn.Module, policy: Any = None) -> nn.Module:
    """A copy of ``model`` with each block replaced by ``funckpt.remat(block)``."""
    model = copy.deepcopy(model)
    for seq, i in blocks_of(model):
        seq[int(i)] = funckpt.remat(seq[int(i)], policy=policy)
    return model


def with_grad_checkpointing(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    model.set_grad_checkpointing(True)
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _loss(out: Any) -> torch.Tensor:
    return F.cross_entropy(out, LABELS)


def backward_results(model: nn.Module, x: torch.Tensor, *, seed: int = 5) -> dict[str, Any]:
    """Output, parameter gradients, input gradient and buffers after one forward and backward."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = model(x)
    _loss(out).backward()
    return {
        "out": out.detach(),
        "grads": _grads(model),
        "x.grad": x.grad,
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
    }


def func_grad_results(model: nn.Module, x: torch.Tensor, *, seed: int = 5, trainable_only: bool = False):
    """torch.func.grad of the loss w.r.t. the parameters, through functional_call.

    The buffers are an argument of the transformed function: BatchNorm in training
    mode writes them in place, which torch.func refuses for a captured tensor."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad or not trainable_only}
    frozen = {k: v.detach() for k, v in model.named_parameters() if k not in params}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def loss(params, buffers):
        return _loss(tf.functional_call(model, (params, frozen, buffers), (x,)))

    torch.manual_seed(seed)
    return {"grads": tf.grad(loss)(params, buffers), "buffers": buffers}


def _check_batchnorm_stepped_once(buffers: dict[str, torch.Tensor]) -> None:
    counters = [int(v) for k, v in buffers.items() if k.endswith("num_batches_tracked")]
    assert counters and all(c == 1 for c in counters), counters


# ---------------------------------------------------------------------------
# 1. timm's own gradient checkpointing, routed to funckpt, and remat'd blocks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_timm_grad_checkpointing_backward(name, routed):
    reference, x = build(name)
    model = with_grad_checkpointing(reference)  # copied before the reference steps its statistics
    expected = backward_results(reference, x)
    got = backward_results(model, x)
    assert routed, "set_grad_checkpointing(True) made no checkpoint call"
    assert_close(got, expected)
    if name in BATCHNORM:
        _check_batchnorm_stepped_once(got["buffers"])


@pytest.mark.parametrize("name", list(MODELS))
def test_timm_grad_checkpointing_torch_func_grad(name, routed):
    reference, x = build(name)
    model = with_grad_checkpointing(reference)
    expected = func_grad_results(reference, x)
    got = func_grad_results(model, x)
    assert routed
    assert_close(got, expected)
    if name in BATCHNORM:
        _check_batchnorm_stepped_once(got["buffers"])


@pytest.mark.parametrize("name", ["resnet", "convnext", "vit", "efficientnet", "swin", "maxvit", "mixer", "nfnet"])
def test_remat_blocks_backward_and_torch_func_grad(name):
    reference, x = build(name)
    model = remat_blocks(reference)
    assert_close(backward_results(model, x), backward_results(reference, x))
    assert_close(func_grad_results(model, x), func_grad_results(reference, x))


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_randomness_is_on_and_replayed(name, routed):
    """The models draw random numbers (another seed gives another output), and the checkpointed
    model's gradients equal the plain model's under each seed: the masks are replayed."""
    reference, x = build(name)
    model = with_grad_checkpointing(reference)
    for seed in (5, 6):
        assert_close(backward_results(model, x, seed=seed), backward_results(reference, x, seed=seed))
        model.zero_grad()
        reference.zero_grad()
    torch.manual_seed(5)
    a = reference(x)
    torch.manual_seed(6)
    assert not torch.allclose(a, reference(x)), "dropout is off: the test would not see a wrong mask"


def test_batchnorm_running_statistics_updated_once(routed, monkeypatch):
    """README: remat updates BatchNorm's running statistics once per forward pass; the
    recomputation updates a copy. torch.utils.checkpoint itself updates them twice, which
    shows that the comparison would catch a second update."""
    reference, x = build("resnet")
    backward_results(reference, x)
    model = with_grad_checkpointing(build("resnet")[0])
    backward_results(model, x)
    assert routed
    assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))
    _check_batchnorm_stepped_once(dict(model.named_buffers()))

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", _TORCH_CHECKPOINT)
    upstream = with_grad_checkpointing(build("resnet")[0])
    backward_results(upstream, x)
    counters = [int(v) for k, v in upstream.named_buffers() if k.endswith("num_batches_tracked")]
    assert max(counters) == 2, counters  # torch's recomputation stepped them again


def test_two_training_steps_with_an_optimizer(routed):
    """AdamW steps with BatchNorm (ResNet) and with dropout (ViT): the whole state stays equal."""
    for name in ("resnet", "vit"):
        reference, _ = build(name)
        models = [reference, with_grad_checkpointing(reference), remat_blocks(reference)]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        for step in range(3):
            x = torch.randn(2, 3, 32, 32, dtype=D)
            for m, opt in zip(models, opts):
                torch.manual_seed(step)
                opt.zero_grad()
                _loss(m(x)).backward()
                opt.step()
        for m in models[1:]:
            assert_close(m.state_dict(), reference.state_dict())


# ---------------------------------------------------------------------------
# 2. Frozen weights (fine-tuning)
# ---------------------------------------------------------------------------


FREEZE = {
    "resnet-stem-and-layer1": ("resnet", lambda m: [m.conv1, m.bn1, m.layer1]),
    "resnet-batchnorms": ("resnet", lambda m: [x for x in m.modules() if isinstance(x, nn.BatchNorm2d)]),
    "resnet-convs": ("resnet", lambda m: [x for x in m.modules() if isinstance(x, nn.Conv2d)]),
    "resnet-all-but-head": ("resnet", lambda m: [x for n, x in m.named_children() if n != "fc"]),
    "vit-embedding-and-first-block": ("vit", lambda m: [m.patch_embed, m.blocks[0]]),
    "vit-attention": ("vit", lambda m: [b.attn for b in m.blocks]),
    "vit-norms": ("vit", lambda m: [b.norm1 for b in m.blocks]),
    "vit-all-but-head": ("vit", lambda m: [x for n, x in m.named_children() if n != "head"]),
    "convnext-stem-and-stage0": ("convnext", lambda m: [m.stem, m.stages[0]]),
    "swin-attention": ("swin", lambda m: [x for x in m.modules() if type(x).__name__ == "WindowAttention"]),
}


def _frozen(name: str, how: str) -> tuple[nn.Module, torch.Tensor]:
    model, x = build(name)
    for part in FREEZE[how][1](model):
        part.requires_grad_(False)
    if how.startswith("vit-embedding"):
        model.pos_embed.requires_grad_(False)
        model.cls_token.requires_grad_(False)
    return model, x


@pytest.mark.parametrize("how", list(FREEZE))
def test_frozen_weights(how, routed):
    name = FREEZE[how][0]
    for checkpointed in (with_grad_checkpointing, remat_blocks):
        reference, x = _frozen(name, how)
        model = checkpointed(reference)
        assert_close(backward_results(model, x), backward_results(reference, x))
        assert_close(
            func_grad_results(model, x, trainable_only=True), func_grad_results(reference, x, trainable_only=True)
        )
    assert routed


def test_timm_freeze_helpers(routed):
    """timm.utils.freeze (requires_grad off, BatchNorm converted to FrozenBatchNorm2d)."""
    from timm.layers import freeze_batch_norm_2d
    from timm.utils.model import freeze

    for prepare in (lambda m: freeze(m, ["conv1", "bn1", "layer1"]) or m, freeze_batch_norm_2d):
        reference = prepare(build("resnet")[0])
        x = build("resnet")[1]
        model = with_grad_checkpointing(reference)
        assert_close(backward_results(model, x), backward_results(reference, x))
        assert_close(
            func_grad_results(model, x, trainable_only=True), func_grad_results(reference, x, trainable_only=True)
        )


# ---------------------------------------------------------------------------
# 3. torch.func transforms: per-example gradients, Jacobians, forward mode
# ---------------------------------------------------------------------------


def _per_example_grads(model: nn.Module, x: torch.Tensor, *, randomness: str = "error") -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(params, xi, yi):
        return F.cross_entropy(tf.functional_call(model, (params, buffers), (xi[None],)), yi[None])

    torch.manual_seed(5)
    return tf.vmap(tf.grad(loss), in_dims=(None, 0, 0), randomness=randomness)(params, x, LABELS)


@pytest.mark.parametrize("name", ["resnet", "vit", "convnext", "efficientnet", "swin", "mobilenetv3"])
def test_vmap_grad_per_example_eval_mode(name, routed):
    """Per-example gradients (BatchNorm in eval mode: torch's vmap has no train-mode BatchNorm)."""
    reference, x = build(name, train=False)
    expected = _per_example_grads(reference, x)
    assert_close(_per_example_grads(remat_blocks(reference), x), expected)
    assert_close(_per_example_grads(with_grad_checkpointing(reference), x), expected)
    assert routed


def test_vmap_grad_per_example_with_train_mode_batchnorm_replaced():
    """torch.func.replace_all_batch_norm_modules_: train-mode BatchNorm without running statistics."""
    reference, _ = build("resnet")
    tf.replace_all_batch_norm_modules_(reference)
    x = torch.randn(2, 3, 64, 64, dtype=D)  # the last stage needs more than one value per channel
    assert_close(_per_example_grads(remat_blocks(reference), x), _per_example_grads(reference, x))


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_vmap_grad_per_example_with_dropout(randomness):
    reference, x = build("vit")
    assert_close(
        _per_example_grads(remat_blocks(reference), x, randomness=randomness),
        _per_example_grads(reference, x, randomness=randomness),
    )


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_jacrev_and_forward_mode(name, routed):
    """jacrev w.r.t. the input and w.r.t. a weight matrix, jvp w.r.t. the input, jacfwd w.r.t. a
    norm's weight, in eval mode (ViT on the manual attention path: CPU flash attention has no
    forward-mode derivative)."""
    reference, x = build(name, train=False)
    _unfused(reference)
    x = x[:1]
    models = [remat_blocks(reference), with_grad_checkpointing(reference)]
    params = dict(reference.named_parameters())
    matrix = [k for k, v in params.items() if v.dim() >= 2][1]
    vector = [k for k, v in params.items() if v.dim() == 1 and ("blocks" in k or "layer" in k)][0]

    def of(model, name):
        return lambda w: tf.functional_call(model, {name: w}, (x,))

    transforms = {
        "jacrev(x)": lambda m: tf.jacrev(m)(x),
        f"jacrev({matrix})": lambda m: tf.jacrev(of(m, matrix))(params[matrix].detach()),
        "jvp(x)": lambda m: tf.jvp(m, (x,), (torch.ones_like(x),)),
        f"jacfwd({vector})": lambda m: tf.jacfwd(of(m, vector))(params[vector].detach()),
    }
    for how, transform in transforms.items():
        expected = transform(reference)
        for model in models:
            assert_close(transform(model), expected, msg=lambda m, how=how: f"{how}: {m}")
    assert routed


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_hessian_vector_product_forward_over_reverse(name, routed):
    """jvp(grad(loss)) w.r.t. all parameters, eval mode (BatchNorm's statistics are inputs
    without a tangent: the case fixed in 3b7c387)."""
    reference, x = build(name, train=False)
    _unfused(reference)
    models = [remat_blocks(reference), with_grad_checkpointing(reference)]
    params = {k: v.detach() for k, v in reference.named_parameters()}
    g = torch.Generator().manual_seed(3)
    tangents = {k: torch.randn(v.shape, dtype=D, generator=g) for k, v in params.items()}

    def hvp(model):
        def loss(p):
            return _loss(tf.functional_call(model, p, (x,)))

        return tf.jvp(tf.grad(loss), (params,), (tangents,))

    expected = hvp(reference)
    for model in models:
        assert_close(hvp(model), expected)
    assert routed


@pytest.mark.parametrize("name", ["resnet", "convnext", "vit"])
def test_double_backward_gradient_penalty(name, routed):
    """A gradient penalty: autograd.grad(create_graph=True) w.r.t. the input, then backward."""
    reference, x = build(name)
    _unfused(reference)  # CPU flash attention has no double backward

    def penalized(model):
        torch.manual_seed(5)
        xx = x.clone().requires_grad_()
        loss = _loss(model(xx))
        (g,) = torch.autograd.grad(loss, xx, create_graph=True)
        (loss + g.square().sum()).backward()
        return _grads(model)

    models = [with_grad_checkpointing(reference), remat_blocks(reference)]
    expected = penalized(reference)
    for model in models:
        assert_close(penalized(model), expected)


# ---------------------------------------------------------------------------
# 4. Policies
# ---------------------------------------------------------------------------


POLICIES = {
    "dots_saveable": policies.dots_saveable,
    "nothing_saveable": policies.nothing_saveable,
    "everything_saveable": policies.everything_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "memory_budget(0.5)": policies.memory_budget(0.5),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["resnet", "vit", "convnext"])
def test_policies(name, policy):
    reference, x = build(name)
    model = remat_blocks(reference, POLICIES[policy])
    assert_close(backward_results(model, x), backward_results(reference, x))
    assert_close(func_grad_results(model, x), func_grad_results(reference, x))


def test_dots_saveable_keeps_the_convolutions():
    """dots_saveable keeps a ResNet block's convolution outputs (and nothing_saveable does not)."""
    reference, x = build("resnet", train=False)
    block = reference.layer1[0]
    h = reference.maxpool(reference.act1(reference.bn1(reference.conv1(x)))).detach().requires_grad_()
    kept = funckpt.saved_residuals(funckpt.remat(block, policy=policies.dots_saveable), h)
    nothing = funckpt.saved_residuals(funckpt.remat(block, policy=policies.nothing_saveable), h)
    assert len(kept) > len(nothing)


# ---------------------------------------------------------------------------
# 5. Other ways into a model: features_only, forward_intermediates, densenet,
#    channels_last; and where remat cannot be right (LeViT's eval-mode cache)
# ---------------------------------------------------------------------------


def _sum_of_squares(outs):
    return sum(t.square().mean() for t in outs)


def test_features_only(routed):
    torch.manual_seed(0)
    reference = _perturb(timm.create_model("test_resnet", features_only=True).to(D)).train()
    x = build("resnet")[1]
    model = copy.deepcopy(reference)
    model.set_grad_checkpointing(True)
    results = []
    for m in (reference, model):
        outs = m(x)
        _sum_of_squares(outs).backward()
        results.append((outs, _grads(m), dict(m.named_buffers())))
    assert routed
    assert_close(results[1], results[0])


@pytest.mark.parametrize("name", ["resnet", "vit", "convnext", "swin"])
def test_forward_intermediates(name, routed):
    reference, x = build(name)
    model = with_grad_checkpointing(reference)
    results = []
    for m in (reference, model):
        torch.manual_seed(5)
        outs = m.forward_intermediates(x, intermediates_only=True)
        _sum_of_squares(outs).backward()
        results.append((outs, _grads(m), dict(m.named_buffers())))
    assert routed
    assert_close(results[1], results[0])


def test_densenet_memory_efficient(routed):
    """DenseNet's memory_efficient layers checkpoint a closure over a list of feature maps
    (checkpoint(closure, *features)); compared with memory_efficient=False."""

    def make(memory_efficient):
        torch.manual_seed(0)
        return _perturb(
            timm.models.densenet.DenseNet(
                growth_rate=8, block_config=(1, 2), bn_size=2, num_classes=3, memory_efficient=memory_efficient
            ).to(D)
        )

    reference, model = make(False), make(True)
    x = build("resnet")[1]
    assert_close(backward_results(model, x), backward_results(reference, x))
    assert routed
    assert_close(func_grad_results(model, x), func_grad_results(reference, x))


def test_vovnet_layers_appending_to_the_callers_list():
    """VoVNet's ``SequentialAppendList`` appends each layer's output to a list its caller passes
    and then concatenates (``torch.utils.checkpoint`` runs it): each one remat'd, the caller's
    list gets the outputs, with their gradients, as without remat, under ``.backward()`` and
    ``torch.func.grad``."""
    cfg = dict(
        stem_chs=[8, 8, 8], stage_conv_chs=[8, 8, 8, 8], stage_out_chs=[8, 8, 16, 16], layer_per_block=2,
        block_per_stage=[1, 1, 1, 1], residual=True, depthwise=False, attn="ese",
    )
    torch.manual_seed(0)
    reference = _perturb(timm.models.vovnet.VovNet(cfg, num_classes=3).to(D)).train()
    model = copy.deepcopy(reference)
    wrapped = 0
    for block in model.modules():
        if isinstance(block, timm.models.vovnet.OsaBlock):
            block.conv_mid = funckpt.remat(block.conv_mid)
            wrapped += 1
    assert wrapped == 4
    x = build("resnet")[1]
    assert_close(backward_results(model, x), backward_results(reference, x))
    assert_close(func_grad_results(model, x), func_grad_results(reference, x))  # (each call's outputs, in the list)


def test_channels_last(routed):
    reference, x = build("resnet")
    reference = reference.to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    assert_close(backward_results(with_grad_checkpointing(reference), x), backward_results(reference, x))


def test_inference_under_no_grad(routed):
    """Checkpointing left on for evaluation under torch.no_grad(): same outputs, no graph."""
    for name in ("resnet", "vit", "swin"):
        reference, x = build(name, train=False)
        model = with_grad_checkpointing(reference)
        with torch.no_grad():
            expected, got = reference(x), model(x)
        assert not got.requires_grad
        assert_close(got, expected)
    assert routed


def test_vit_dynamic_image_size(routed):
    """dynamic_img_size=True: the position embedding is resampled per input size, call by call."""
    torch.manual_seed(0)
    reference = _perturb(
        timm.models.vision_transformer.VisionTransformer(
            img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3, dynamic_img_size=True,
            **_DROP,
        ).to(D)
    ).train()
    model = with_grad_checkpointing(reference)
    for res in (32, 40, 24):
        x = torch.randn(2, 3, res, res, dtype=D)
        assert_close(backward_results(model, x), backward_results(reference, x))
    assert routed


def test_levit_train_mode():
    torch.manual_seed(0)
    reference = _perturb(timm.create_model("levit_128s", num_classes=3, img_size=64).to(D)).train()
    x = torch.randn(2, 3, 64, 64, dtype=D)
    assert_close(backward_results(remat_blocks(reference), x), backward_results(reference, x))


def test_levit_eval_mode_attention_bias_cache_raises():
    """In eval mode LeViT caches its attention biases (computed from a parameter, with a graph)
    in a module attribute on the first call. Computed inside a checkpointed region, that tensor
    outlives the region; the region's recomputation then reads the cache where the forward run
    computed the bias, and the bias's gradient cannot flow: remat refuses it (README, "Side
    effects") instead of silently dropping it, under .backward() and torch.func. (Under torch.func
    the cached bias, in a dict, becomes an output of the call too, as under .backward(), and the
    recomputation's read of it is refused with the same message.)"""
    torch.manual_seed(0)
    model = remat_blocks(timm.create_model("levit_128s", num_classes=3, img_size=64).to(D).eval())
    x = torch.randn(2, 3, 64, 64, dtype=D)
    with pytest.raises(funckpt.CheckpointError, match="a remat'd call computed earlier and that was kept outside"):
        _loss(model(x)).backward()
    for m in model.modules():  # a fresh cache, as after model.train()/eval()
        if hasattr(m, "attention_bias_cache"):
            m.attention_bias_cache = {}
    with pytest.raises(funckpt.CheckpointError, match="a remat'd call computed earlier and that was kept outside"):
        func_grad_results(model, x)


# ---------------------------------------------------------------------------
# 6. timm's checkpoint_seq replaced by funckpt.checkpoint_sequential; PEFT adapters
# ---------------------------------------------------------------------------


def _checkpoint_sequential_as_checkpoint_seq(functions, x, every=1, flatten=False, skip_last=False, use_reentrant=None):
    """timm's ``checkpoint_seq`` written with ``funckpt.checkpoint_sequential``: chunks of ``every``
    functions, the last one run without checkpointing (checkpoint_sequential's semantics)."""
    import itertools
    import math

    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    if flatten:
        functions = list(itertools.chain.from_iterable(functions))
    functions = list(functions)
    return funckpt.checkpoint_sequential(functions, max(1, math.ceil(len(functions) / every)), x, use_reentrant=False)


@pytest.mark.parametrize("name", ["resnet", "vit", "swin", "efficientnet", "nfnet"])
def test_checkpoint_seq_replaced_by_funckpt_checkpoint_sequential(name, monkeypatch, routed):
    """A training script that swaps timm's ``checkpoint_seq`` (every module that imported it) for
    ``funckpt.checkpoint_sequential`` (and its ``checkpoint`` for ``funckpt.checkpoint``: ViT and
    Swin checkpoint block by block): the same gradients and buffers as without checkpointing
    under ``.backward()`` and ``torch.func.grad``, BatchNorm stepped once."""
    import sys

    from timm.models import _manipulate

    sequences = []

    def checkpoint_seq(*args, **kwargs):
        sequences.append(args[0])
        return _checkpoint_sequential_as_checkpoint_seq(*args, **kwargs)

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("timm.models.") and getattr(module, "checkpoint_seq", None) is _manipulate.checkpoint_seq:
            monkeypatch.setattr(module, "checkpoint_seq", checkpoint_seq)
    reference, x = build(name)
    model = with_grad_checkpointing(reference)
    got = backward_results(model, x)
    assert_close(got, backward_results(reference, x))
    if name in BATCHNORM:
        _check_batchnorm_stepped_once(got["buffers"])
    reference, x = build(name)
    assert_close(func_grad_results(with_grad_checkpointing(reference), x), func_grad_results(reference, x))
    assert sequences or routed


def _peft_on_timm(name: str, kind: str) -> tuple[nn.Module, torch.Tensor]:
    peft = pytest.importorskip("peft")
    model, x = build(name)
    targets = {"vit": ["qkv", "fc1"], "resnet": r".*layer\d\.\d\.conv\d", "convnext": r".*mlp\.fc\d"}[name]
    torch.manual_seed(1)
    if kind == "lora":
        config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=targets, init_lora_weights=False)
    elif kind == "dora":
        config = peft.LoraConfig(
            r=2, lora_alpha=4, lora_dropout=0.1, target_modules=targets, init_lora_weights=False, use_dora=True
        )
    else:
        config = peft.IA3Config(target_modules=targets, feedforward_modules=[], init_ia3_weights=False)
    return peft.get_peft_model(model, config).to(D), x


PEFT_ON_TIMM = [("vit", "lora"), ("vit", "dora"), ("vit", "ia3"), ("resnet", "lora"), ("convnext", "lora")]


@pytest.mark.parametrize("name,kind", PEFT_ON_TIMM)
def test_peft_adapters_on_timm_models(name, kind, routed):
    """PEFT adapters (LoRA with adapter dropout, DoRA, IA3; on linear layers and on ResNet's
    convolutions) over a frozen timm model with ``set_grad_checkpointing``, and with remat'd
    blocks: the adapters' gradients under ``.backward()`` and ``torch.func.grad`` of the
    trainable parameters only, and per-example ``vmap(grad)`` (training mode, both randomness
    modes, where no BatchNorm; eval mode otherwise)."""
    reference, x = _peft_on_timm(name, kind)

    def remat_inner_blocks(model):
        model = copy.deepcopy(model)
        for seq, i in blocks_of(model.base_model.model):
            seq[int(i)] = funckpt.remat(seq[int(i)])
        return model

    def set_grad_checkpointing(model):
        model = copy.deepcopy(model)
        model.base_model.model.set_grad_checkpointing(True)
        return model

    def per_example(model, randomness):
        params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

        def loss(p, xi, yi):
            return F.cross_entropy(tf.functional_call(model, p, (xi[None],)), yi[None])

        torch.manual_seed(5)
        return tf.vmap(tf.grad(loss), in_dims=(None, 0, 0), randomness=randomness)(params, x, LABELS)

    for checkpointed in (set_grad_checkpointing, remat_inner_blocks):
        reference.zero_grad(set_to_none=True)
        model = checkpointed(reference)
        expected = backward_results(copy.deepcopy(reference), x)
        assert expected["grads"] and all(g is not None for g in expected["grads"].values())
        assert_close(backward_results(model, x), expected)
        model = checkpointed(reference)  # (its BatchNorm statistics as the reference's)
        assert_close(
            func_grad_results(model, x, trainable_only=True), func_grad_results(reference, x, trainable_only=True)
        )
        if name in BATCHNORM:
            assert_close(per_example(model.eval(), "error"), per_example(copy.deepcopy(reference).eval(), "error"))
        else:
            for randomness in ("same", "different"):
                assert_close(per_example(model, randomness), per_example(reference, randomness))
    assert routed
