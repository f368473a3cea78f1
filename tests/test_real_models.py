"""funckpt on real third-party models: tiny HuggingFace transformers and timm's pattern.

Every model is built from a tiny config with random weights (nothing is downloaded),
in float64, and every result is compared with the same model run without
checkpointing. Three ways in are covered:

- HF's own gradient checkpointing, with the checkpoint function routed to
  ``funckpt.checkpoint`` (what a user of ``model.gradient_checkpointing_enable()``
  gets by swapping one function);
- ``funckpt.remat(layer)`` put in place of each layer of the model's ``ModuleList``;
- both under ``torch.func`` (``grad``, ``vmap(grad)``, ``jacrev``) through
  ``functional_call``.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.func as tf  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch.testing import assert_close  # noqa: E402

import funckpt  # noqa: E402

transformers.logging.set_verbosity_error()

D = torch.float64
V = 64  # vocabulary size
B, S = 2, 8  # batch size, sequence length
T = 6  # T5 decoder length
H = 16  # hidden size

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*"),
    # torch's own note that vmap falls back to a loop for CPU flash attention
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


# ---------------------------------------------------------------------------
# The models: a tiny config each, the inputs, a float64 loss, the layer lists.
# ---------------------------------------------------------------------------


@dataclass
class Spec:
    build: Callable[[float], nn.Module]  # dropout probability -> model
    inputs: Callable[[], dict[str, Any]]  # keyword arguments of model(**inputs)
    loss: Callable[[Any, dict[str, Any]], torch.Tensor]  # (model output, inputs) -> scalar
    layer_lists: Callable[[nn.Module], list[nn.ModuleList]]


def _ids(*shape):
    return torch.randint(1, V, shape)


def _causal_lm_loss(out, inputs):
    # computed here in float64: HF's own loss upcasts the logits to float32
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs["input_ids"][:, 1:].reshape(-1))


def _classifier_loss(labels):
    return lambda out, inputs: F.cross_entropy(out.logits, labels)


def _gpt2(p):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=H, n_layer=2, n_head=2,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return transformers.GPT2LMHeadModel(cfg).to(D)


def _llama(p):
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, attention_dropout=p,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg).to(D)


def _bert(p):
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=p, attention_probs_dropout_prob=p,
        pad_token_id=0,
    )
    return transformers.BertForSequenceClassification(cfg).to(D)


def _vit(p):
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_labels=3, hidden_dropout_prob=p, attention_probs_dropout_prob=p,
    )
    return transformers.ViTForImageClassification(cfg).to(D)


def _t5(p):
    cfg = transformers.T5Config(
        vocab_size=V, d_model=H, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=p,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False,
    )
    return transformers.T5ForConditionalGeneration(cfg).to(D)


def _t5_inputs():
    return dict(input_ids=_ids(B, S), decoder_input_ids=_ids(B, T), labels_=_ids(B, T))


def _t5_loss(out, inputs):
    return F.cross_entropy(out.logits.reshape(-1, V), inputs["labels_"].reshape(-1))


def _bert_inputs():
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -2:] = 0  # padding in the second example
    return dict(input_ids=_ids(B, S), attention_mask=mask)


def _vit_layers(m):
    vit = m.vit
    return [vit.layers if hasattr(vit, "layers") else vit.encoder.layer]


_LABELS = torch.tensor([0, 2])

SPECS = {
    "gpt2": Spec(_gpt2, lambda: dict(input_ids=_ids(B, S)), _causal_lm_loss, lambda m: [m.transformer.h]),
    "llama": Spec(_llama, lambda: dict(input_ids=_ids(B, S)), _causal_lm_loss, lambda m: [m.model.layers]),
    "bert": Spec(_bert, _bert_inputs, _classifier_loss(_LABELS), lambda m: [m.bert.encoder.layer]),
    "vit": Spec(
        _vit, lambda: dict(pixel_values=torch.randn(B, 3, 8, 8, dtype=D)), _classifier_loss(_LABELS), _vit_layers
    ),
    "t5": Spec(_t5, _t5_inputs, _t5_loss, lambda m: [m.encoder.block, m.decoder.block]),
}
MODELS = list(SPECS)


def _model_kwargs(inputs):
    return {k: v for k, v in inputs.items() if not k.endswith("_")}


def _loss(spec, model, inputs):
    return spec.loss(model(**_model_kwargs(inputs)), inputs)


def _functional_loss(spec, model, inputs):
    def loss(params):
        return spec.loss(tf.functional_call(model, params, (), _model_kwargs(inputs)), inputs)

    return loss


def _params(model):
    return {name: p.detach() for name, p in model.named_parameters()}


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _backward_grads(spec, model, inputs, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    _loss(spec, model, inputs).backward()
    grads = _grads(model)
    assert grads and all(g is not None for g in grads.values()), "a trainable parameter got no gradient"
    return grads


# ---------------------------------------------------------------------------
# The two ways of checkpointing a model.
# ---------------------------------------------------------------------------


def _enable_hf_checkpointing(model, checkpoint_fn):
    """HF's gradient checkpointing with ``checkpoint_fn`` in place of torch.utils.checkpoint.

    ``gradient_checkpointing_enable`` (``activation_checkpointing_enable`` in newer
    versions) binds ``torch.utils.checkpoint.checkpoint`` into each checkpointing
    module's ``_gradient_checkpointing_func``; the layers call that attribute as
    ``func(partial(layer.forward, **kwargs), *args)``. Returns the list of calls made.
    """
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    calls = []

    def routed(function, *args, **kwargs):
        calls.append(function)
        return checkpoint_fn(function, *args, **kwargs)

    routed_fn = functools.partial(routed, use_reentrant=False)
    modules = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert modules, "HF set no checkpointing function"
    for m in modules:
        m._gradient_checkpointing_func = routed_fn
    return calls


def _n_layers(spec, model):
    return sum(len(layers) for layers in spec.layer_lists(model))


def _remat_layers(spec, model):
    for layers in spec.layer_lists(model):
        for i in range(len(layers)):
            layers[i] = funckpt.remat(layers[i])
    return model


def _pair(name, dropout=0.0):
    """A model and a deep copy with the same weights; both in train mode."""
    spec = SPECS[name]
    torch.manual_seed(0)
    reference = spec.build(dropout).train()
    return spec, reference, copy.deepcopy(reference)


# ---------------------------------------------------------------------------
# 1. HF's gradient checkpointing, routed to funckpt.checkpoint, under .backward()
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_hf_gradient_checkpointing_routed_to_funckpt(name):
    spec, reference, model = _pair(name)
    inputs = spec.inputs()
    calls = _enable_hf_checkpointing(model, funckpt.checkpoint)
    expected = _backward_grads(spec, reference, inputs)
    got = _backward_grads(spec, model, inputs)
    assert len(calls) == _n_layers(spec, model), "HF did not call funckpt.checkpoint once per layer"
    assert got.keys() == expected.keys()
    assert_close(got, expected)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_gradient_checkpointing_with_the_models_own_loss(name):
    # as a Trainer runs it: labels= and the model's loss (which HF computes in float32)
    spec, reference, model = _pair(name)
    _enable_hf_checkpointing(model, funckpt.checkpoint)
    ids = spec.inputs()["input_ids"]
    for m in (reference, model):
        m(input_ids=ids, labels=ids).loss.backward()
    assert_close(_grads(model), _grads(reference))


# ---------------------------------------------------------------------------
# 2. remat(layer) in place of each layer, under .backward()
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_remat_layers_backward(name):
    spec, reference, model = _pair(name)
    inputs = spec.inputs()
    _remat_layers(spec, model)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    loss_ref = _loss(spec, reference, inputs)
    loss = _loss(spec, model, inputs)
    assert_close(loss, loss_ref)
    loss_ref.backward()
    loss.backward()
    assert_close(_grads(model), _grads(reference))


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_remat_layers_in_eval_mode_match_outputs(name):
    spec, reference, model = _pair(name)
    reference.eval()
    model.eval()
    _remat_layers(spec, model)
    inputs = spec.inputs()
    with torch.no_grad():
        assert_close(model(**_model_kwargs(inputs)).logits, reference(**_model_kwargs(inputs)).logits)


@pytest.mark.parametrize("name", MODELS)
def test_remat_layers_return_the_hidden_states_and_attentions_the_model_collects(name):
    """``output_hidden_states`` and ``output_attentions`` with remat'd layers: every collected tensor
    as without remat, and gradients through them. transformers finds the layers whose outputs
    it collects by class (``isinstance(module, LlamaDecoderLayer)``): a wrapper that were not an
    instance of its layer's class would be skipped, its hidden states silently missing."""
    spec, reference, model = _pair(name)
    _remat_layers(spec, model)
    inputs = spec.inputs()
    kwargs = dict(_model_kwargs(inputs), output_hidden_states=True, output_attentions=True)
    outs = [torch.utils._pytree.tree_leaves(m(**kwargs)) for m in (reference, model)]
    assert len(outs[1]) == len(outs[0])
    assert_close(outs[1], outs[0])
    for out in outs:
        sum(t.square().sum() for t in out if t.is_floating_point()).backward()
    assert_close(_grads(model), _grads(reference))


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_the_trainer_finds_remat_layers_by_class_name_to_wrap_with_fsdp(name):
    """``fsdp_transformer_layer_cls_to_wrap`` names the layer class; the Trainer finds it by name
    among the model's modules, then wraps every instance of it."""
    from transformers.trainer_pt_utils import get_module_class_from_name

    spec, reference, model = _pair(name)
    _remat_layers(spec, model)
    layer_class = type(spec.layer_lists(reference)[0][0])
    found = get_module_class_from_name(model, layer_class.__name__)
    assert found is not None and issubclass(found, layer_class)
    layers = [m for layers in spec.layer_lists(model) for m in layers]
    assert [m for m in model.modules() if isinstance(m, found)] == layers


# ---------------------------------------------------------------------------
# 3. torch.func.grad through functional_call
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("how", ["hf", "remat"])
def test_torch_func_grad(name, how):
    spec, reference, model = _pair(name)
    inputs = spec.inputs()
    if how == "hf":
        calls = _enable_hf_checkpointing(model, funckpt.checkpoint)
        # HF's enable registers a forward hook that calls requires_grad_() on the
        # embeddings' output, which torch.func refuses; it is not needed under torch.func.
        model.disable_input_require_grads()
    else:
        _remat_layers(spec, model)
    params = _params(reference)
    expected = tf.grad(_functional_loss(spec, reference, inputs))(params)
    got = tf.grad(_functional_loss(spec, model, inputs))(params)
    if how == "hf":
        assert len(calls) == _n_layers(spec, model)
    assert_close(got, expected)
    # and the same as plain autograd on the un-checkpointed model
    assert_close(expected, _backward_grads(spec, reference, inputs))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_torch_func_grad_and_value_with_remat_layers_and_hf_checkpointing(name):
    # both at once: remat'd layers whose inner forward also goes through HF's
    # checkpoint function (a remat inside a remat).
    spec, reference, model = _pair(name)
    inputs = spec.inputs()
    _enable_hf_checkpointing(model, funckpt.checkpoint)
    model.disable_input_require_grads()
    _remat_layers(spec, model)
    params = _params(reference)
    g_ref, v_ref = tf.grad_and_value(_functional_loss(spec, reference, inputs))(params)
    g, v = tf.grad_and_value(_functional_loss(spec, model, inputs))(params)
    assert_close(v, v_ref)
    assert_close(g, g_ref)


# ---------------------------------------------------------------------------
# 4. per-example gradients: vmap(grad) of a BERT classifier
# ---------------------------------------------------------------------------


def _mask_4d(mask):
    # HF turns a 2D padding mask into a 4D one with a data-dependent shortcut (no
    # padding: no mask) that vmap refuses; a ready 4D mask (True: attend) is used as is.
    return mask[:, None, None, :].bool().expand(-1, 1, mask.shape[-1], -1)


def _per_example_grads(model, ids, mask, labels, randomness="error"):
    params = _params(model)

    def loss(p, ids, mask, label):
        out = tf.functional_call(model, p, (), dict(input_ids=ids[None], attention_mask=_mask_4d(mask[None])))
        return F.cross_entropy(out.logits, label[None])

    torch.manual_seed(1)
    return tf.vmap(tf.grad(loss), in_dims=(None, 0, 0, 0), randomness=randomness)(params, ids, mask, labels)


def test_vmap_grad_per_example_bert_remat_layers():
    spec, reference, model = _pair("bert")
    reference.eval()
    model.eval()
    _remat_layers(spec, model)
    inputs = spec.inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    expected = _per_example_grads(reference, ids, mask, _LABELS)
    got = _per_example_grads(model, ids, mask, _LABELS)
    assert_close(got, expected)
    # sanity of the reference: the per-example gradients average to the gradient of
    # the batch's mean loss
    params = _params(reference)
    batch_inputs = dict(input_ids=ids, attention_mask=_mask_4d(mask))
    batch = tf.grad(lambda p: spec.loss(tf.functional_call(reference, p, (), batch_inputs), inputs))(params)
    assert_close({k: g.mean(0) for k, g in expected.items()}, batch)


def test_vmap_grad_per_example_bert_hf_checkpointing():
    spec, reference, model = _pair("bert")  # train mode (HF checkpoints only then), dropout 0
    _enable_hf_checkpointing(model, funckpt.checkpoint)
    model.disable_input_require_grads()
    inputs = spec.inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    # nn.Dropout draws random numbers in train mode even with p=0: "same" lets vmap run it
    expected = _per_example_grads(reference, ids, mask, _LABELS, randomness="same")
    got = _per_example_grads(model, ids, mask, _LABELS, randomness="same")
    assert_close(got, expected)


# ---------------------------------------------------------------------------
# 5. jacrev through remat'd layers
# ---------------------------------------------------------------------------


def test_jacrev_gpt2_logits_wrt_inputs_embeds():
    spec, reference, model = _pair("gpt2")
    reference.eval()
    model.eval()
    _remat_layers(spec, model)
    embeds = torch.randn(1, 6, H, dtype=D)

    def last_logits(m):
        return lambda e: m(inputs_embeds=e).logits[0, -1]

    expected = tf.jacrev(last_logits(reference))(embeds)
    assert expected.shape == (V, 1, 6, H)
    assert_close(tf.jacrev(last_logits(model))(embeds), expected)


def test_jacrev_llama_logits_wrt_one_parameter():
    spec, reference, model = _pair("llama")
    reference.eval()
    model.eval()
    _remat_layers(spec, model)
    ids = _ids(1, 6)
    name = "model.layers.0.mlp.down_proj.weight"
    params = _params(reference)

    def last_logits(m):
        def f(w):
            return tf.functional_call(m, {**params, name: w}, (), dict(input_ids=ids)).logits[0, -1]

        return f

    expected = tf.jacrev(last_logits(reference))(params[name])
    assert expected.shape == (V, *params[name].shape)
    assert_close(tf.jacrev(last_logits(model))(params[name]), expected)


# ---------------------------------------------------------------------------
# 6. Fine-tuning with frozen weights
# ---------------------------------------------------------------------------


def _freeze(model, trainable):
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))


_FROZEN = {
    # LoRA-like: only some projections inside the layers are trained
    "llama": lambda n: n.endswith(("q_proj.weight", "v_proj.weight")),
    # head-only: nothing inside the checkpointed layers is trained
    "bert": lambda n: n.startswith("classifier."),
    # final layer norm plus one matrix per layer
    "gpt2": lambda n: n.startswith("transformer.ln_f.") or n.endswith("mlp.c_fc.weight"),
    "t5": lambda n: "SelfAttention.v" in n or n.startswith("decoder.final_layer_norm"),
}


@pytest.mark.parametrize("name", list(_FROZEN))
@pytest.mark.parametrize("how", ["hf", "remat"])
def test_frozen_weights_backward(name, how):
    spec, reference, model = _pair(name)
    _freeze(reference, _FROZEN[name])
    _freeze(model, _FROZEN[name])
    inputs = spec.inputs()
    if how == "hf":
        _enable_hf_checkpointing(model, funckpt.checkpoint)
    else:
        _remat_layers(spec, model)
    expected = _backward_grads(spec, reference, inputs)
    got = _backward_grads(spec, model, inputs)
    assert got.keys() == expected.keys() and len(got) < len(list(model.parameters()))
    assert_close(got, expected)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("how", ["hf", "remat"])
def test_frozen_weights_torch_func_grad_of_trainable_only(name, how):
    spec, reference, model = _pair(name)
    _freeze(reference, _FROZEN[name])
    _freeze(model, _FROZEN[name])
    inputs = spec.inputs()
    if how == "hf":
        _enable_hf_checkpointing(model, funckpt.checkpoint)
        model.disable_input_require_grads()
    else:
        _remat_layers(spec, model)
    trainable = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    # the frozen parameters are not passed: functional_call takes them from the module
    expected = tf.grad(_functional_loss(spec, reference, inputs))(trainable)
    got = tf.grad(_functional_loss(spec, model, inputs))(trainable)
    assert_close(got, expected)


def test_frozen_multihead_attention_remat():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(H, 2, batch_first=True, dtype=D)
    mha.in_proj_weight.requires_grad_(False)
    mha.in_proj_bias.requires_grad_(False)
    wrapped = funckpt.remat(copy.deepcopy(mha))
    x = torch.randn(B, S, H, dtype=D)

    def run(m):
        xg = x.clone().requires_grad_()
        out, weights = m(xg, xg, xg)
        (out.square().sum() + weights.sum()).backward()
        return xg.grad, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    x_ref, g_ref = run(mha)
    x_got, g_got = run(wrapped)
    assert_close(x_got, x_ref)
    assert_close(g_got, g_ref)
    assert wrapped.in_proj_weight.grad is None

    params = {n: p.detach() for n, p in mha.named_parameters() if p.requires_grad}

    def loss(m):
        return lambda p, x: tf.functional_call(m, p, (x, x, x))[0].square().sum()

    assert_close(
        tf.grad(loss(wrapped), argnums=(0, 1))(params, x), tf.grad(loss(mha), argnums=(0, 1))(params, x)
    )


@pytest.mark.parametrize("train_inside", [True, False])
def test_frozen_transformer_encoder_layer_remat(train_inside):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(H, 2, dim_feedforward=32, dropout=0.0, batch_first=True, dtype=D)
    for n, p in layer.named_parameters():
        # either one matrix inside stays trainable, or none (only the input gets a gradient)
        p.requires_grad_(train_inside and n == "linear1.weight")
    stack = nn.Sequential(layer, copy.deepcopy(layer))
    checkpointed = nn.Sequential(*(funckpt.remat(m) for m in copy.deepcopy(stack)))
    x = torch.randn(B, S, H, dtype=D)

    def run(m):
        xg = x.clone().requires_grad_()
        m(xg).square().sum().backward()
        return xg.grad, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    x_ref, g_ref = run(stack.train())
    x_got, g_got = run(checkpointed.train())
    assert_close(x_got, x_ref)
    assert_close(g_got, g_ref)
    assert len(g_ref) == (2 if train_inside else 0)


# ---------------------------------------------------------------------------
# 7. Dropout on: the same masks in the recomputation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_dropout_hf_checkpointing_funckpt_equals_torch_checkpoint(name):
    spec = SPECS[name]
    torch.manual_seed(0)
    plain = spec.build(0.1).train()
    with_torch, with_funckpt = copy.deepcopy(plain), copy.deepcopy(plain)
    _enable_hf_checkpointing(with_torch, torch.utils.checkpoint.checkpoint)
    _enable_hf_checkpointing(with_funckpt, funckpt.checkpoint)
    inputs = spec.inputs()
    expected = _backward_grads(spec, with_torch, inputs, seed=123)
    got = _backward_grads(spec, with_funckpt, inputs, seed=123)
    assert_close(got, expected)
    # checkpointing with preserved RNG state does not change the masks at all
    assert_close(expected, _backward_grads(spec, plain, inputs, seed=123))
    # and dropout really is on: another seed gives other gradients
    other = _backward_grads(spec, copy.deepcopy(plain), inputs, seed=124)
    assert not torch.allclose(torch.cat([g.flatten() for g in other.values()]),
                              torch.cat([g.flatten() for g in expected.values()]))


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_dropout_remat_layers_backward(name):
    spec = SPECS[name]
    torch.manual_seed(0)
    plain = spec.build(0.1).train()
    model = _remat_layers(spec, copy.deepcopy(plain))
    inputs = spec.inputs()
    assert_close(_backward_grads(spec, model, inputs, seed=7), _backward_grads(spec, plain, inputs, seed=7))


def test_dropout_torch_func_grad_remat_layers():
    spec = SPECS["gpt2"]
    torch.manual_seed(0)
    plain = spec.build(0.1).train()
    model = _remat_layers(spec, copy.deepcopy(plain))
    inputs = spec.inputs()
    params = _params(plain)
    torch.manual_seed(5)
    expected = tf.grad(_functional_loss(spec, plain, inputs))(params)
    torch.manual_seed(5)
    got = tf.grad(_functional_loss(spec, model, inputs))(params)
    assert_close(got, expected)


# ---------------------------------------------------------------------------
# 8. timm's checkpoint_seq pattern, with BatchNorm in train mode
# ---------------------------------------------------------------------------


def _checkpoint_seq(functions, x, checkpoint_fn, every=1, skip_last=False):
    """A replica of ``timm.models._manipulate.checkpoint_seq``.

    Each chunk is a closure over the whole tuple of modules that runs only some of
    them; with ``skip_last`` the last module runs outside any checkpoint.
    """

    def run_function(start, end, functions):
        def forward(_x):
            for j in range(start, end + 1):
                _x = functions[j](_x)
            return _x

        return forward

    if isinstance(functions, nn.Sequential):
        functions = functions.children()
    if not isinstance(functions, (tuple, list)):
        functions = tuple(functions)
    num_checkpointed = len(functions) - 1 if skip_last else len(functions)
    end = -1
    for start in range(0, num_checkpointed, every):
        end = min(start + every - 1, num_checkpointed - 1)
        x = checkpoint_fn(run_function(start, end, functions), x, use_reentrant=False, preserve_rng_state=True)
    if skip_last:
        return run_function(end + 1, len(functions) - 1, functions)(x)
    return x


class _ConvNet(nn.Module):
    """A small timm-style net: stem, stages run by checkpoint_seq, head."""

    def __init__(self, checkpoint_fn=None):
        super().__init__()
        self.checkpoint_fn = checkpoint_fn

        def block(c_in, c_out):
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

        self.stem = block(3, 4)  # BatchNorm before the checkpointed chunks
        self.stages = nn.Sequential(block(4, 4), block(4, 6), block(6, 6), block(6, 8), block(8, 8))
        self.head_norm = nn.BatchNorm2d(8)  # BatchNorm after them
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        if self.checkpoint_fn is None:
            x = self.stages(x)
        else:
            # chunks [0, 1] and [2, 3] checkpointed; stage 4 (with its BatchNorm) runs
            # plainly, between the chunks' forward and their recomputation
            x = _checkpoint_seq(self.stages, x, self.checkpoint_fn, every=2, skip_last=True)
        x = self.head_norm(x)
        return self.fc(x.mean((2, 3)))


def test_timm_checkpoint_seq_with_batchnorm():
    # (torch.utils.checkpoint would fail the buffer check: its recomputation updates
    # the checkpointed BatchNorms' running statistics a second time)
    torch.manual_seed(0)
    reference = _ConvNet().to(D).train()
    model = copy.deepcopy(reference)
    model.checkpoint_fn = funckpt.checkpoint
    x, y = torch.randn(4, 3, 8, 8, dtype=D), torch.tensor([0, 1, 2, 1])
    for m in (reference, model):
        F.cross_entropy(m(x), y).backward()
    assert_close(_grads(model), _grads(reference))
    assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))
    assert all(int(b) == 1 for n, b in model.named_buffers() if n.endswith("num_batches_tracked"))


def test_timm_checkpoint_seq_two_steps_with_optimizer():
    torch.manual_seed(0)
    reference = _ConvNet().to(D).train()
    model = copy.deepcopy(reference)
    model.checkpoint_fn = funckpt.checkpoint
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, model)]
    for step in range(2):
        x, y = torch.randn(4, 3, 8, 8, dtype=D), torch.tensor([0, 1, 2, 1])
        for m, opt in zip((reference, model), opts):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    assert_close(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("checkpoints", [None, 1, 2])
def test_scan_over_stacked_hf_gpt2_layers(checkpoints, dropout):
    """JAX's scan-over-layers pattern: the layers' parameters stacked as xs, one block as the step;
    with dropout, the same masks as the Python loop under the same seed."""
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=H, n_layer=4, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
    )
    blocks = list(transformers.GPT2Model(cfg).to(D).h)
    params, buffers = tf.stack_module_state(blocks)
    params = {k: v.detach() for k, v in params.items()}
    template = copy.deepcopy(blocks[0]).to("meta")
    buffers_one = {k: v[0] for k, v in buffers.items()}

    def step(h, p):
        out = tf.functional_call(template, (p, buffers_one), (h,))
        return (out[0] if isinstance(out, tuple) else out), None

    def with_scan(params, h0):
        return funckpt.scan(step, h0, params, checkpoints=checkpoints)[0].pow(2).mean()

    def plain(params, h0):
        h = h0
        for i in range(len(blocks)):
            h, _ = step(h, {k: v[i] for k, v in params.items()})
        return h.pow(2).mean()

    def seeded(fn, *args):
        torch.manual_seed(0)
        return fn(*args)

    h0 = torch.randn(B, S, H, dtype=D)
    assert_close(seeded(tf.grad(with_scan), params, h0), seeded(tf.grad(plain), params, h0))
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    seeded(with_scan, leaves, h0).backward()
    seeded(plain, ref, h0).backward()
    assert_close({k: v.grad for k, v in leaves.items()}, {k: v.grad for k, v in ref.items()})


@pytest.mark.parametrize("where", ["layers", "model"])
def test_a_key_value_cache_left_on_is_refused_naming_use_cache(where):
    """HF causal LMs fill a key/value cache by default (``use_cache=True``): the cache keeps a
    tensor the layers compute outside them, whose gradient remat cannot route. The refusal says
    to call the model with ``use_cache=False``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(1, 50, (2, 6))
    if where == "layers":
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = funckpt.remat(layer)
        call = model
    else:
        call = funckpt.remat(model)
    with pytest.raises(funckpt.CheckpointError, match="use_cache=False"):
        call(input_ids=ids, labels=ids).loss.backward()
    call(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # (as the README says)


def test_a_key_value_cache_left_on_is_refused_under_vmap_grad_with_a_policy():
    """Per-example gradients of a Llama whose layers keep their matmuls (``dots_saveable``): the
    forward run records no graph there, and a recomputation appending to the cache again would
    attend over every key twice (same values, half the gradient). It is refused; with
    ``use_cache=False`` the gradients are those without remat."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    plain = transformers.LlamaForCausalLM(config).train().to(D)
    model = copy.deepcopy(plain)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = funckpt.remat(layer, policy=funckpt.policies.dots_saveable)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    ids = torch.randint(1, 50, (3, 6))

    def per_example(m, use_cache):
        def loss(p, one):
            return tf.functional_call(m, p, (), dict(input_ids=one[None], labels=one[None], use_cache=use_cache)).loss

        return tf.vmap(tf.grad(loss), in_dims=(None, 0))(params, ids)

    with pytest.raises(funckpt.CheckpointError, match="use_cache=False"):
        per_example(model, True)
    assert_close(per_example(model, False), per_example(plain, False))


@pytest.mark.parametrize("first_call", ["before remat", "after remat"])
def test_hidden_states_recorded_by_hooks_under_vmap_grad_with_a_policy(first_call):
    """transformers 5 records ``output_hidden_states`` with a forward hook it puts on each decoder
    layer at the model's first call. Put there before the layers are remat'd, the hook is the
    wrapped layer's own, and runs around the checkpointed forward; put there after, on remat's
    wrapper, it runs around the wrapper's call. Either way it keeps the caller's tensor, and the
    gradients are those without remat."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    plain = transformers.LlamaForCausalLM(config).train().to(D)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    ids = torch.randint(1, 50, (3, 6))

    def per_example(m, hidden):
        def loss(p, one):
            out = tf.functional_call(m, p, (), dict(input_ids=one[None], use_cache=False, output_hidden_states=hidden))
            return out.hidden_states[1].square().sum() if hidden else out.logits.square().sum()

        return tf.vmap(tf.grad(loss), in_dims=(None, 0))(params, ids)

    if first_call == "before remat":
        plain(input_ids=ids[:1], use_cache=False, output_hidden_states=True)
    model = copy.deepcopy(plain)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = funckpt.remat(layer, policy=funckpt.policies.everything_saveable)
    if first_call == "before remat":
        assert any(model.model.layers[0].wrapped._forward_hooks.values())  # (the case this test is for)
    assert_close(per_example(model, True), per_example(plain, True))
    assert_close(per_example(model, False), per_example(plain, False))
