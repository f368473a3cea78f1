"""funckpt on diffusers' diffusion and flow models: denoisers, their Jacobians, samplers.

Every model is built by diffusers from a tiny configuration with random weights (nothing
is downloaded), in float64, with every parameter perturbed (diffusers zero-initialises
some output layers, where gradients would be trivially zero), and every result is
compared with the same model run without checkpointing. Ways in:

- diffusers' own ``enable_gradient_checkpointing()``: its default
  ``_gradient_checkpointing_func`` calls ``torch.utils.checkpoint.checkpoint(module.__call__,
  *args, use_reentrant=False)``; that one name is routed to ``funckpt.checkpoint`` and the
  tests check it was called. Also ``enable_gradient_checkpointing(funckpt-based function)``;
- ``funckpt.remat(block)`` put in place of each block of the model's block lists;
- ``torch.func`` (``grad``, ``vmap(grad)``, ``jacrev``, ``jvp``, ``jacfwd``, ``vjp``,
  Hessian-vector products ``jvp(grad)``) through ``functional_call``: the divergence of a
  flow model's velocity field (exact trace of the Jacobian and Hutchinson's estimator),
  and a few sampler steps differentiated through ``funckpt.scan``/``fori_loop``.

Dropout is on (``dropout=0.1``) in the training-mode models. UNet2DModel's resnets apply
dropout to channels-last tensors (after an attention block): there ``torch.func.grad``
itself draws another mask than eager mode with the same seed (it decomposes dropout into
``bernoulli`` on a contiguous ``empty``; a torch behaviour, README "Limitations"), and remat
replays the eager mask. The ``torch.func.grad`` tests therefore compare with the eager
``.backward()`` of the model without checkpointing (which remat matches wherever every
dropout is inside a checkpointed call), and with the un-checkpointed ``torch.func.grad``
where no dropout is on.

Forward mode (``jvp``/``jacfwd``) uses diffusers' plain ``AttnProcessor`` (softmax(q k^T) v):
``AttnProcessor2_0`` calls ``scaled_dot_product_attention``, whose CPU flash kernel has no
forward-mode derivative (the model without checkpointing fails the same way).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
diffusers = pytest.importorskip("diffusers")

import torch  # noqa: E402
import torch.func as tf  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch.testing import assert_close  # noqa: E402

import funckpt  # noqa: E402

diffusers.utils.logging.set_verbosity_error()

D = torch.float64
B = 2

pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# ---------------------------------------------------------------------------
# The models: tiny configurations and their inputs
# ---------------------------------------------------------------------------


def _unet2d(dropout: float) -> nn.Module:
    # ResnetBlock2D (GroupNorm, timestep embedding), self-attention blocks, down/upsampling
    return diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, attention_head_dim=4, dropout=dropout,
    )


def _unet_cond(dropout: float) -> nn.Module:
    # Stable-Diffusion-style: Transformer2DModel blocks with cross-attention on encoder_hidden_states
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8, norm_num_groups=4, attention_head_dim=2, dropout=dropout,
    )


def _dit(dropout: float) -> nn.Module:
    # DiT: patch embedding, adaLN-Zero conditioned on timestep and class label
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=4, in_channels=4, out_channels=4, num_layers=2, sample_size=8,
        patch_size=2, num_embeds_ada_norm=10, dropout=dropout,
    )


def _sd3(dropout: float) -> nn.Module:
    # MMDiT (joint attention over image and text tokens, the last block context_pre_only)
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
        joint_attention_dim=8, caption_projection_dim=8, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=8,
    )


def _flux(dropout: float) -> nn.Module:
    # Flux: double-stream and single-stream blocks, rotary position embeddings
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=8, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )


def _vae(dropout: float) -> nn.Module:
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4,
        sample_size=16, layers_per_block=1,
    )


BUILDERS: dict[str, Callable[[float], nn.Module]] = {
    "unet2d": _unet2d, "unet_cond": _unet_cond, "dit": _dit, "sd3": _sd3, "flux": _flux, "vae": _vae,
}
# Those with dropout in their configuration (0.1 in training mode)
DROPOUT = {"unet2d", "unet_cond", "dit"}


def _perturb(model: nn.Module) -> nn.Module:
    """Noise on every parameter: diffusers zero-initialises e.g. DiT's adaLN-Zero modulation
    and some output projections, where gradients would be trivially zero."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=g))
    return model


def build(name: str, *, train: bool = True, dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return _perturb(BUILDERS[name](dropout).to(D)).train(train)


def inputs(name: str, batch: int = B) -> tuple[torch.Tensor, dict[str, Any]]:
    """The noisy input x and the conditioning keyword arguments (timesteps, text, labels)."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, dtype=D, generator=g)

    t = torch.tensor([3, 7, 5, 1][:batch])
    if name == "unet2d":
        return r(batch, 3, 8, 8), dict(timestep=t)
    if name == "unet_cond":
        return r(batch, 4, 8, 8), dict(timestep=t, encoder_hidden_states=r(batch, 5, 8))
    if name == "dit":
        return r(batch, 4, 8, 8), dict(timestep=t, class_labels=torch.tensor([1, 4, 2, 0][:batch]))
    if name == "sd3":
        return r(batch, 4, 8, 8), dict(timestep=t, encoder_hidden_states=r(batch, 5, 8), pooled_projections=r(batch, 8))
    if name == "flux":
        img_ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1
        ).reshape(16, 3)
        return r(batch, 16, 4), dict(
            timestep=t.to(D) / 10, encoder_hidden_states=r(batch, 5, 8), pooled_projections=r(batch, 8),
            img_ids=img_ids.to(D), txt_ids=torch.zeros(5, 3, dtype=D),
        )
    if name == "vae":
        return r(batch, 3, 16, 16), {}
    raise KeyError(name)


def blocks_of(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """(list, index) of each block diffusers checkpoints (and the UNets' mid block)."""
    lists = []
    for path in ("down_blocks", "up_blocks", "transformer_blocks", "single_transformer_blocks",
                 "encoder.down_blocks", "decoder.up_blocks"):
        mod = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.ModuleList):
            lists.append(mod)
    assert lists, type(model).__name__
    return [(lst, i) for lst in lists for i in range(len(lst))]


def remat_blocks(model: nn.Module, policy: Any = None) -> nn.Module:
    model = copy.deepcopy(model)
    for lst, i in blocks_of(model):
        lst[i] = funckpt.remat(lst[i], policy=policy)
    for owner in (model, getattr(model, "encoder", None), getattr(model, "decoder", None)):
        if getattr(owner, "mid_block", None) is not None:
            owner.mid_block = funckpt.remat(owner.mid_block, policy=policy)
    return model


def with_grad_checkpointing(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    model.enable_gradient_checkpointing()
    assert model.is_gradient_checkpointing
    return model


def _refuse_torch_checkpoint(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.utils.checkpoint.checkpoint was called")

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", refuse)


def forward(model: nn.Module, name: str, x: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
    if name == "vae":
        # encode, sample the posterior with an explicit generator, decode
        return model(x, sample_posterior=True, generator=torch.Generator().manual_seed(7)).sample
    return model(x, **kw).sample


def _loss(out: torch.Tensor) -> torch.Tensor:
    target = torch.linspace(-1, 1, out.numel(), dtype=D).reshape(out.shape)
    return (out - target).square().mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def backward_results(model: nn.Module, name: str, *, seed: int = 5) -> dict[str, Any]:
    x, kw = inputs(name)
    x = x.requires_grad_()
    torch.manual_seed(seed)
    out = forward(model, name, x, kw)
    _loss(out).backward()
    return {"out": out.detach(), "grads": _grads(model), "x.grad": x.grad}


def func_grad_results(model: nn.Module, name: str, *, seed: int = 5) -> dict[str, Any]:
    """torch.func.grad_and_value w.r.t. the trainable parameters and the noisy input."""
    x, kw = inputs(name)
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss(params, x):
        out = forward(_Functional(model, params), name, x, kw)
        return _loss(out), out

    torch.manual_seed(seed)
    (g, gx), out = tf.grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return {"out": out, "grads": g, "x.grad": gx}


class _Functional:
    """model(...) through functional_call with the given parameters (the others as they are)."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor]):
        self.model, self.params = model, params

    def __call__(self, *args, **kwargs):
        return tf.functional_call(self.model, self.params, args, kwargs)


def _nonzero(grads: dict[str, torch.Tensor | None]) -> None:
    """The comparison must see gradients: most are nonzero (SD3's last block's text-query
    projection is unused by design, context_pre_only)."""
    zero = [k for k, v in grads.items() if v is None or not v.abs().max() > 0]
    assert len(zero) <= 2, zero


# ---------------------------------------------------------------------------
# 1. diffusers' enable_gradient_checkpointing() routed to funckpt, remat'd blocks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILDERS))
def test_enable_gradient_checkpointing_backward(name, routed):
    reference = build(name)
    expected = backward_results(reference, name)
    _nonzero(expected["grads"])
    got = backward_results(with_grad_checkpointing(reference), name)
    assert routed, "enable_gradient_checkpointing() made no checkpoint call"
    assert_close(got, expected)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_enable_gradient_checkpointing_torch_func_grad(name, routed):
    # UNet2DModel's mid block runs its first resnet (dropout on a channels-last tensor)
    # without checkpointing: under torch.func.grad that one draws torch.func's mask, the
    # checkpointed ones eager mode's, and neither reference has both. Dropout off there
    # (test_remat_blocks has it on, every dropout inside a remat'd block).
    reference = build(name, dropout=0.0 if name == "unet2d" else 0.1)
    model = with_grad_checkpointing(reference)
    got = func_grad_results(model, name)
    assert routed
    # remat replays eager mode's dropout masks: equal to the eager model without checkpointing
    assert_close(got, backward_results(reference, name))
    if name not in DROPOUT:
        assert_close(got, func_grad_results(reference, name))


@pytest.mark.parametrize("name", ["unet2d", "unet_cond", "dit"])
def test_torch_func_grad_without_dropout_equals_torch_func_grad(name, routed):
    reference = build(name, dropout=0.0)
    model = with_grad_checkpointing(reference)
    assert_close(func_grad_results(model, name), func_grad_results(reference, name))
    assert routed


@pytest.mark.parametrize("name", list(BUILDERS))
def test_remat_blocks(name, monkeypatch):
    reference = build(name)
    model = remat_blocks(reference)
    _refuse_torch_checkpoint(monkeypatch)
    expected = backward_results(reference, name)
    assert_close(backward_results(model, name), expected)
    # (against the model under torch.func.grad too: its dropout of a non-contiguous tensor takes
    # functorch's kernel there, which draws another mask than ATen's under .backward())
    assert_close(func_grad_results(model, name), func_grad_results(reference, name))


def test_gradient_checkpointing_func_argument(monkeypatch):
    """enable_gradient_checkpointing(gradient_checkpointing_func=...) with funckpt.checkpoint."""
    _refuse_torch_checkpoint(monkeypatch)
    calls = []

    def ckpt(module, *args):
        calls.append(module)
        return funckpt.checkpoint(module, *args, use_reentrant=False)

    reference = build("unet_cond")
    model = copy.deepcopy(reference)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=ckpt)
    expected = backward_results(reference, "unet_cond")
    assert_close(backward_results(model, "unet_cond"), expected)
    assert_close(func_grad_results(model, "unet_cond"), func_grad_results(reference, "unet_cond"))
    assert calls


@pytest.mark.parametrize("name", ["unet2d", "dit"])
def test_randomness_is_on_and_replayed(name, routed):
    """Dropout draws (another seed, another output) and each seed's gradients are equal."""
    reference = build(name)
    model = with_grad_checkpointing(reference)
    for seed in (5, 6):
        assert_close(backward_results(model, name, seed=seed), backward_results(reference, name, seed=seed))
        model.zero_grad()
        reference.zero_grad()
    assert not torch.allclose(
        backward_results(reference, name, seed=5)["out"], backward_results(reference, name, seed=6)["out"]
    )


def test_training_steps_with_an_optimizer(routed):
    """AdamW steps on a noise-prediction loss (random noise and timesteps, dropout on)."""
    reference = build("unet_cond")
    models = [reference, with_grad_checkpointing(reference), remat_blocks(reference)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    _, kw = inputs("unet_cond")
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x0 = torch.randn(B, 4, 8, 8, dtype=D, generator=g)
        noise = torch.randn(B, 4, 8, 8, dtype=D, generator=g)
        t = torch.randint(0, 10, (B,), generator=g)
        xt = (1 - t / 10).view(-1, 1, 1, 1) * x0 + (t / 10).view(-1, 1, 1, 1) * noise
        for m, opt in zip(models, opts):
            torch.manual_seed(step)
            opt.zero_grad()
            (m(xt, t, kw["encoder_hidden_states"]).sample - noise).square().mean().backward()
            opt.step()
    assert routed
    for m in models[1:]:
        assert_close(m.state_dict(), reference.state_dict())


def test_inference_under_no_grad_between_forward_and_backward(routed):
    """An evaluation under torch.no_grad() (checkpointing stays on: diffusers skips it when
    grad is off) between the training forward and its backward."""
    reference = build("unet_cond")
    model = with_grad_checkpointing(reference)
    x, kw = inputs("unet_cond")
    results = []
    for m in (reference, model):
        torch.manual_seed(5)
        xx = x.clone().requires_grad_()
        out = m(xx, **kw).sample
        with torch.no_grad():
            evaluated = m.eval()(x, **kw).sample
        m.train()
        _loss(out).backward()
        results.append((out, evaluated, xx.grad, _grads(m)))
    assert not results[1][1].requires_grad
    assert_close(results[1], results[0])
    assert routed


def test_frozen_vae_trainable_unet(routed):
    """Latent diffusion fine-tuning: a frozen VAE encodes (under checkpointing, inside the
    graph), the trainable UNet denoises; gradients reach the UNet and the image only."""
    refs = (build("vae").requires_grad_(False), build("unet_cond"))
    models = tuple(with_grad_checkpointing(m) for m in refs)
    img, _ = inputs("vae")
    _, kw = inputs("unet_cond")
    noise = torch.randn(B, 4, 8, 8, dtype=D, generator=torch.Generator().manual_seed(3))

    def step(vae, unet):
        torch.manual_seed(5)
        x = img.clone().requires_grad_()
        latents = vae.encode(x).latent_dist.sample(torch.Generator().manual_seed(4))
        out = unet(latents + noise, **kw).sample
        _loss(out).backward()
        return out, x.grad, _grads(vae), _grads(unet)

    expected = step(*refs)
    got = step(*models)
    assert got[2] == {} and all(p.grad is None for p in models[0].parameters())
    assert_close(got, expected)
    assert routed


# ---------------------------------------------------------------------------
# 2. torch.func: per-example gradients, Jacobians w.r.t. the noisy input, divergence
# ---------------------------------------------------------------------------


def _plain_attention(model: nn.Module) -> nn.Module:
    from diffusers.models.attention_processor import Attention, AttnProcessor

    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert attentions
    for m in attentions:
        m.set_processor(AttnProcessor())
    return model


@pytest.mark.parametrize("name", ["unet_cond", "dit", "sd3"])
def test_vmap_grad_per_example(name, routed):
    reference = build(name, train=False)
    x, kw = inputs(name)
    params = {k: v.detach() for k, v in reference.named_parameters()}

    def per_example(model):
        def loss(params, xi, kwi):
            kwi = {k: v[None] for k, v in kwi.items()}
            return _loss(tf.functional_call(model, params, (xi[None],), kwi).sample)

        return tf.vmap(tf.grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0))(params, x, kw)

    expected = per_example(reference)
    assert_close(per_example(remat_blocks(reference)), expected)
    assert_close(per_example(with_grad_checkpointing(reference)), expected)
    assert routed


def _denoiser(model: nn.Module, name: str, kw: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: model(x, **kw).sample


@pytest.mark.parametrize("name", ["unet_cond", "dit"])
def test_jacobians_wrt_the_noisy_input(name, routed):
    """jacrev, jvp and jacfwd of the denoiser's output w.r.t. its input (plain AttnProcessor)."""
    reference = _plain_attention(build(name, train=False))
    x, kw = inputs(name, batch=1)
    v = torch.randn(x.shape, dtype=D, generator=torch.Generator().manual_seed(9))
    transforms = {
        "jacrev": lambda f: tf.jacrev(f)(x),
        "jvp": lambda f: tf.jvp(f, (x,), (v,)),
        "jacfwd": lambda f: tf.jacfwd(f)(x),
    }
    models = [remat_blocks(reference), with_grad_checkpointing(reference)]
    for how, transform in transforms.items():
        expected = transform(_denoiser(reference, name, kw))
        for model in models:
            assert_close(transform(_denoiser(model, name, kw)), expected, msg=lambda m, how=how: f"{how}: {m}")
    assert routed


@pytest.mark.parametrize("name", ["unet_cond", "dit", "flux"])
def test_jacrev_with_sdpa_attention(name, routed):
    """Reverse mode with the default processors (scaled_dot_product_attention)."""
    reference = build(name, train=False)
    x, kw = inputs(name, batch=1)
    expected = tf.jacrev(_denoiser(reference, name, kw))(x)
    for model in (remat_blocks(reference), with_grad_checkpointing(reference)):
        assert_close(tf.jacrev(_denoiser(model, name, kw))(x), expected)
    assert routed


def _divergences(f: Callable, x: torch.Tensor, probes: torch.Tensor) -> dict[str, torch.Tensor]:
    """The divergence of a velocity field f at x: exact (trace of jacrev), and Hutchinson's
    estimates with reverse-mode (vjp, vmapped over probes) and forward-mode (jvp) products."""
    n = x.numel()
    exact = tf.jacrev(f)(x).reshape(n, n).trace()
    out, vjp_fn = tf.vjp(f, x)
    vjps = tf.vmap(vjp_fn)(probes)[0]
    hutchinson_rev = (vjps * probes).flatten(1).sum(1).mean()
    jvps = torch.stack([tf.jvp(f, (x,), (p,))[1] for p in probes])
    hutchinson_fwd = (jvps * probes).flatten(1).sum(1).mean()
    return {"out": out, "exact": exact, "vjp": hutchinson_rev, "jvp": hutchinson_fwd}


@pytest.mark.parametrize("name", ["dit", "unet_cond"])
def test_divergence_hutchinson(name, routed):
    """Flow-model log-likelihoods need the divergence of the velocity field."""
    reference = _plain_attention(build(name, train=False))
    x, kw = inputs(name, batch=1)
    probes = torch.randint(0, 2, (3, *x.shape), generator=torch.Generator().manual_seed(4)).to(D) * 2 - 1
    expected = _divergences(_denoiser(reference, name, kw), x, probes)
    for model in (remat_blocks(reference), with_grad_checkpointing(reference)):
        assert_close(_divergences(_denoiser(model, name, kw), x, probes), expected)
    assert routed


@pytest.mark.parametrize("name", ["dit", "unet_cond"])
def test_hessian_vector_product(name, routed):
    """jvp(grad(loss)) w.r.t. all parameters and the input (forward over reverse), through
    SiLU everywhere (the case fixed with this file: remat's backward under a jvp level ran
    with grad mode off, where SiLU's backward formula calls silu_backward, which has no
    forward-mode derivative). UNet2DModel is left out: without checkpointing torch itself
    fails there (GroupNorm's forward-over-reverse on the channels-last tensors after its
    attention blocks: "view size is not compatible with input tensor's size and stride")."""
    reference = _plain_attention(build(name, train=False))
    x, kw = inputs(name)
    params = {k: v.detach() for k, v in reference.named_parameters()}
    g = torch.Generator().manual_seed(3)
    tangents = ({k: torch.randn(v.shape, dtype=D, generator=g) for k, v in params.items()},
                torch.randn(x.shape, dtype=D, generator=g))

    def hvp(model):
        def loss(p, x):
            return _loss(tf.functional_call(model, p, (x,), kw).sample)

        return tf.jvp(tf.grad(loss, argnums=(0, 1)), (params, x), tangents)

    expected = hvp(reference)
    for model in (remat_blocks(reference), with_grad_checkpointing(reference)):
        assert_close(hvp(model), expected)
    assert routed


# ---------------------------------------------------------------------------
# 3. Differentiating through a sampler: funckpt.scan / fori_loop against the Python loop
# ---------------------------------------------------------------------------

STEPS = 4


def _euler_step(model, params, kw, i, x):
    """One Euler step of a flow-matching sampler, t from 1 to 0 (the model predicts velocity)."""
    t = 1.0 - i / STEPS
    timestep = torch.full((x.shape[0],), int(t * 10))
    v = tf.functional_call(model, params, (x,), {**kw, "timestep": timestep}).sample
    return x - v / STEPS


@pytest.mark.parametrize("loop", ["scan", "fori_loop", "scan-remat-blocks"])
def test_sampler_loop_gradients(loop, routed):
    """Gradients of a loss on the sample w.r.t. the parameters and the initial noise."""
    name = "dit"
    reference = build(name, train=False)
    x0, kw = inputs(name)
    kw.pop("timestep")
    params = {k: v.detach() for k, v in reference.named_parameters()}

    def python_loop(params, x):
        for i in range(STEPS):
            x = _euler_step(reference, params, kw, i, x)
        return _loss(x)

    model = remat_blocks(reference) if loop.endswith("remat-blocks") else reference

    def checkpointed(params, x):
        if loop == "fori_loop":
            x = funckpt.fori_loop(0, STEPS, lambda i, x: _euler_step(model, params, kw, i, x), x, checkpoints=2)
        else:
            def f(x, i):
                return _euler_step(model, params, kw, int(i), x), None

            x, _ = funckpt.scan(f, x, torch.arange(STEPS), checkpoints=2)
        return _loss(x)

    expected = tf.grad_and_value(python_loop, argnums=(0, 1))(params, x0)
    assert_close(tf.grad_and_value(checkpointed, argnums=(0, 1))(params, x0), expected)
    # and with .backward()
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    x = x0.clone().requires_grad_()
    checkpointed(p, x).backward()
    assert_close(({k: v.grad for k, v in p.items()}, x.grad), expected[0])


def test_enable_freeu_after_remat_blocks():
    """enable_freeu() sets s1, s2, b1, b2 as attributes of each up block: with the blocks remat'd
    it must configure the blocks that run, not their wrappers (it changes the output)."""
    reference = build("unet_cond", train=False)
    model = remat_blocks(reference)
    x, kw = inputs("unet_cond")
    with torch.no_grad():
        plain = forward(reference, "unet_cond", x, kw)
        for m in (reference, model):
            m.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
        expected = forward(reference, "unet_cond", x, kw)
        assert not torch.allclose(expected, plain)
        assert_close(forward(model, "unet_cond", x, kw), expected)
        for m in (reference, model):
            m.disable_freeu()
        assert_close(forward(model, "unet_cond", x, kw), plain)


# ---------------------------------------------------------------------------
# 4. LoRA adapters added through diffusers' PEFT integration (add_adapter)
# ---------------------------------------------------------------------------


def _with_lora(name: str) -> nn.Module:
    """The model frozen, with a LoRA adapter on its attention projections (adapter dropout on),
    both LoRA matrices nonzero (PEFT's default zero B would make the adapter's output vanish)."""
    peft = pytest.importorskip("peft")
    model = build(name).requires_grad_(False)
    torch.manual_seed(1)
    model.add_adapter(
        peft.LoraConfig(
            r=2, lora_alpha=4, lora_dropout=0.1, init_lora_weights=False,
            target_modules=["to_q", "to_k", "to_v", "to_out.0"],
        )
    )
    return model.to(D)


@pytest.mark.parametrize("name", ["unet_cond", "sd3", "flux"])
def test_lora_adapters_trained_through_add_adapter(name, routed):
    """LoRA fine-tuning as diffusers' training scripts do it: only the adapters train, under
    ``.backward()`` and ``torch.func.grad`` (against the eager gradients: remat replays eager
    mode's dropout masks), checkpointed both ways."""
    reference = _with_lora(name)
    expected = backward_results(copy.deepcopy(reference), name)
    assert expected["grads"] and all("lora" in k for k in expected["grads"])
    _nonzero(expected["grads"])
    for checkpointed in (with_grad_checkpointing, remat_blocks):
        assert_close(backward_results(checkpointed(reference), name), expected)
        assert_close(func_grad_results(checkpointed(reference), name), expected)
    assert routed


def test_lora_scale_for_one_forward_pass_raises_and_set_adapters_weights_trains(routed):
    """``cross_attention_kwargs={"scale": s}`` scales the LoRA layers for the model's forward pass
    only (``scale_lora_layers`` before, ``unscale_lora_layers`` after): the recomputation in the
    backward pass computes with the other scale. remat refuses it (``torch.utils.checkpoint``
    silently differentiates activations of the other scale), saying to set the scale for the
    whole step: ``set_adapters(..., weights=[s])`` then gives the gradients of the per-call scale
    without checkpointing. (**Not caught**: an adapter whose output is zero, PEFT's default
    initialisation, computes the same values with either scale; its B matrix then gets the
    gradient of the other scale.)"""
    name = "unet_cond"
    reference = _with_lora(name)
    x, kw = inputs(name)

    def step(model, per_call_scale):
        torch.manual_seed(5)
        xx = x.clone().requires_grad_()
        extra = {"cross_attention_kwargs": {"scale": 0.5}} if per_call_scale else {}
        out = model(xx, **kw, **extra).sample
        _loss(out).backward()
        return {"out": out.detach(), "x.grad": xx.grad, "grads": _grads(model)}

    expected = step(copy.deepcopy(reference), per_call_scale=True)
    for checkpointed in (with_grad_checkpointing, remat_blocks):
        with pytest.raises(funckpt.CheckpointError, match=r"set_adapters\(\.\.\., weights=\[s\]\)"):
            step(checkpointed(reference), per_call_scale=True)
        model = checkpointed(reference)
        model.set_adapters(["default"], weights=[0.5])
        assert_close(step(model, per_call_scale=False), expected)
    assert routed
