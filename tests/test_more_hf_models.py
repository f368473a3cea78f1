"""funckpt on more HuggingFace architectures than test_real_models.py covers.

Mistral, Qwen2/3, Phi, Gemma/Gemma2, Falcon, GPT-NeoX, OPT, Mixtral (a mixture of
experts where some experts get no token), DistilBERT, RoBERTa, DeBERTa-v2, BART,
mBART, Whisper and CLIP, each from a tiny random float64 config (nothing is
downloaded), compared with the same model run without checkpointing:

- HF's gradient checkpointing routed to ``funckpt.checkpoint`` (``use_reentrant``
  True and False), train mode with dropout seeded alike, and eval mode;
- ``funckpt.remat(layer)`` in each layer list, under ``.backward()`` and
  ``torch.func.grad`` of ``functional_call``; ``vmap(grad)`` per-example gradients;
- a frozen base with a few trainable matrices.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.func as tf  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.testing import assert_close  # noqa: E402

import funckpt  # noqa: E402

transformers.logging.set_verbosity_error()
C = transformers

D = torch.float64
V = 64
B, S, T = 2, 8, 6
H = 16

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
]


def ids(*shape):
    return torch.randint(1, V, shape)


common_dec = dict(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
def _build_raw(name, p):
    if name == "mistral":
        m = C.MistralForCausalLM(C.MistralConfig(**common_dec, num_key_value_heads=1, attention_dropout=p, sliding_window=4))
    elif name == "qwen2":
        m = C.Qwen2ForCausalLM(C.Qwen2Config(**common_dec, num_key_value_heads=1, attention_dropout=p))
    elif name == "qwen3":
        m = C.Qwen3ForCausalLM(C.Qwen3Config(**common_dec, num_key_value_heads=1, head_dim=8, attention_dropout=p))
    elif name == "phi":
        m = C.PhiForCausalLM(C.PhiConfig(**common_dec, resid_pdrop=p, embd_pdrop=p, attention_dropout=p, partial_rotary_factor=0.5))
    elif name == "gemma":
        m = C.GemmaForCausalLM(C.GemmaConfig(**common_dec, num_key_value_heads=1, head_dim=8, attention_dropout=p))
    elif name == "gemma2":
        m = C.Gemma2ForCausalLM(C.Gemma2Config(**common_dec, num_key_value_heads=1, head_dim=8, attention_dropout=p, sliding_window=4))
    elif name == "falcon":
        m = C.FalconForCausalLM(C.FalconConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
            hidden_dropout=p, attention_dropout=p, bos_token_id=0, eos_token_id=0, use_cache=False, new_decoder_architecture=False, multi_query=True, alibi=False))
    elif name == "gpt_neox":
        m = C.GPTNeoXForCausalLM(C.GPTNeoXConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, hidden_dropout=p, attention_dropout=p, bos_token_id=0, eos_token_id=0, use_cache=False))
    elif name == "opt":
        m = C.OPTForCausalLM(C.OPTConfig(vocab_size=V, hidden_size=H, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, word_embed_proj_dim=H, dropout=p, attention_dropout=p, activation_dropout=p, layerdrop=0.0,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False))
    elif name == "distilbert":
        m = C.DistilBertForSequenceClassification(C.DistilBertConfig(vocab_size=V, dim=H, hidden_dim=32, n_layers=2, n_heads=2,
            max_position_embeddings=16, dropout=p, attention_dropout=p, seq_classif_dropout=p, num_labels=3, pad_token_id=0))
    elif name == "roberta":
        m = C.RobertaForSequenceClassification(C.RobertaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=20, hidden_dropout_prob=p, attention_probs_dropout_prob=p, num_labels=3, pad_token_id=0))
    elif name == "bart":
        m = C.BartForConditionalGeneration(C.BartConfig(vocab_size=V, d_model=H, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=16, dropout=p, attention_dropout=p, activation_dropout=p,
            encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, use_cache=False))
    elif name == "mbart":
        m = C.MBartForConditionalGeneration(C.MBartConfig(vocab_size=V, d_model=H, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=16, dropout=p, attention_dropout=p, activation_dropout=p,
            encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, use_cache=False))
    elif name == "whisper":
        m = C.WhisperForConditionalGeneration(C.WhisperConfig(vocab_size=V, num_mel_bins=4, d_model=H, encoder_ffn_dim=32, decoder_ffn_dim=32,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, max_source_positions=4, max_target_positions=16,
            dropout=p, attention_dropout=p, activation_dropout=p, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
            pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, use_cache=False))
    elif name == "clip":
        m = C.CLIPModel(C.CLIPConfig(text_config=dict(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, attention_dropout=p, pad_token_id=0, bos_token_id=0, eos_token_id=1),
            vision_config=dict(hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4, attention_dropout=p),
            projection_dim=8))
    elif name == "mixtral":  # eight experts, one per token: some experts get no token at all
        config = C.MixtralConfig(**common_dec, num_key_value_heads=1, attention_dropout=p,
            num_local_experts=8, num_experts_per_tok=1, router_jitter_noise=0.0)
        config._experts_implementation = "eager"  # the grouped-mm kernels take no float64
        m = C.MixtralForCausalLM(config)
    elif name == "deberta_v2":
        m = C.DebertaV2ForSequenceClassification(C.DebertaV2Config(vocab_size=V, hidden_size=H, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16, relative_attention=True, position_buckets=4,
            pos_att_type=["p2c", "c2p"], hidden_dropout_prob=p, attention_probs_dropout_prob=p, num_labels=3, pad_token_id=0))
    elif name == "t5":
        m = C.T5ForConditionalGeneration(C.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=p, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False))
    return m.to(D)


_CLASSES = {
    "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi": "PhiForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "falcon": "FalconForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM", "distilbert": "DistilBertForSequenceClassification",
    "roberta": "RobertaForSequenceClassification", "bart": "BartForConditionalGeneration",
    "mbart": "MBartForConditionalGeneration", "whisper": "WhisperForConditionalGeneration", "clip": "CLIPModel",
    "t5": "T5ForConditionalGeneration", "mixtral": "MixtralForCausalLM",
    "deberta_v2": "DebertaV2ForSequenceClassification",
}


def build(name, p):
    if not hasattr(transformers, _CLASSES[name]):
        pytest.skip(f"transformers {transformers.__version__} has no {_CLASSES[name]}")
    return _build_raw(name, p)


def _clm_loss(out, inp):
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inp["input_ids"][:, 1:].reshape(-1))


_LABELS = torch.tensor([0, 2])


def _cls_loss(out, inp):
    return F.cross_entropy(out.logits, _LABELS)


def _s2s_loss(out, inp):
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), inp["labels_"].reshape(-1))


def _clip_loss(out, inp):
    return out.logits_per_image.square().sum() + out.text_embeds.sum()


def _masked():
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -2:] = 0
    return dict(input_ids=ids(B, S), attention_mask=mask)


def _s2s():
    return dict(input_ids=ids(B, S), decoder_input_ids=ids(B, T), labels_=ids(B, T))


def _lm():
    return dict(input_ids=ids(B, S))


SPECS = {  # inputs, loss, layer lists
    "mistral": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "qwen2": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "qwen3": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "phi": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "gemma": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "gemma2": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "falcon": (_lm, _clm_loss, lambda m: [m.transformer.h]),
    "gpt_neox": (_lm, _clm_loss, lambda m: [m.gpt_neox.layers]),
    "opt": (_lm, _clm_loss, lambda m: [m.model.decoder.layers]),
    "mixtral": (_lm, _clm_loss, lambda m: [m.model.layers]),
    "deberta_v2": (_masked, _cls_loss, lambda m: [m.deberta.encoder.layer]),
    "distilbert": (_masked, _cls_loss, lambda m: [m.distilbert.transformer.layer]),
    "roberta": (_masked, _cls_loss, lambda m: [m.roberta.encoder.layer]),
    "bart": (_s2s, _s2s_loss, lambda m: [m.model.encoder.layers, m.model.decoder.layers]),
    "mbart": (_s2s, _s2s_loss, lambda m: [m.model.encoder.layers, m.model.decoder.layers]),
    "whisper": (
        lambda: dict(input_features=torch.randn(B, 4, 8, dtype=D), decoder_input_ids=ids(B, T), labels_=ids(B, T)),
        _s2s_loss,
        lambda m: [m.model.encoder.layers, m.model.decoder.layers],
    ),
    "clip": (
        lambda: dict(input_ids=ids(B, S), pixel_values=torch.randn(B, 3, 8, 8, dtype=D)),
        _clip_loss,
        lambda m: [m.text_model.encoder.layers, m.vision_model.encoder.layers],
    ),
}
MODELS = list(SPECS)


def _kw(inp):
    return {k: v for k, v in inp.items() if not k.endswith("_")}


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _backward(spec, model, inp, seed):
    torch.manual_seed(seed)
    spec[1](model(**_kw(inp)), inp).backward()
    grads = _grads(model)
    assert grads and all(g is not None for g in grads.values()), "a trainable parameter got no gradient"
    return grads


def _func_grad(spec, model, inp, params, seed):
    torch.manual_seed(seed)
    return tf.grad(lambda p: spec[1](tf.functional_call(model, p, (), _kw(inp)), inp))(params)


def _hf_checkpointing(model, use_reentrant):
    model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
    calls = []

    def routed(function, *args, **kwargs):
        calls.append(function)
        return funckpt.checkpoint(function, *args, **kwargs)

    modules = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert modules, "HF set no checkpointing function"
    for m in modules:
        m._gradient_checkpointing_func = functools.partial(routed, use_reentrant=use_reentrant)
    return calls


def _remat_layers(spec, model):
    for layers in spec[2](model):
        for i in range(len(layers)):
            layers[i] = funckpt.remat(layers[i])
    return model


def _setup(name, dropout=0.1):
    spec = SPECS[name]
    torch.manual_seed(0)
    plain = build(name, dropout).train()
    torch.manual_seed(1)
    return spec, plain, copy.deepcopy(plain), spec[0]()


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_hf_checkpointing_backward(name, use_reentrant, mode):
    spec, reference, model, inp = _setup(name)
    calls = _hf_checkpointing(model, use_reentrant)
    getattr(reference, mode)()
    getattr(model, mode)()
    expected = _backward(spec, reference, inp, 123)
    got = _backward(spec, model, inp, 123)
    assert len(calls) == (sum(len(layers) for layers in spec[2](model)) if mode == "train" else 0)
    assert_close(got, expected)


@pytest.mark.parametrize("name", MODELS)
def test_hf_checkpointing_torch_func_grad(name):
    spec, reference, model, inp = _setup(name)
    calls = _hf_checkpointing(model, False)
    model.disable_input_require_grads()
    params = {n: p.detach() for n, p in reference.named_parameters()}
    assert_close(_func_grad(spec, model, inp, params, 9), _func_grad(spec, reference, inp, params, 9))
    assert calls


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_remat_layers_backward_and_torch_func_grad(name, mode):
    spec, reference, model, inp = _setup(name)
    _remat_layers(spec, model)
    getattr(reference, mode)()
    getattr(model, mode)()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert_close(_backward(spec, model, inp, 5), _backward(spec, reference, inp, 5))
    params = {n: p.detach() for n, p in reference.named_parameters()}
    assert_close(_func_grad(spec, model, inp, params, 9), _func_grad(spec, reference, inp, params, 9))


def _trainable(name):
    return name.endswith((
        "q_proj.weight", "v_proj.weight", "query.weight", "query_proj.weight", "q_lin.weight", "dense_4h_to_h.weight", "fc2.weight",
        "mlp.fc1.weight", "mlp.dense_h_to_4h.weight",
    ))


@pytest.mark.parametrize("how", ["hf-reentrant", "hf", "remat"])
@pytest.mark.parametrize("name", MODELS)
def test_frozen_base(name, how):
    spec, reference, model, inp = _setup(name)
    for m in (reference, model):
        for n, p in m.named_parameters():
            p.requires_grad_(_trainable(n))
    assert 0 < sum(p.requires_grad for p in model.parameters()) < len(list(model.parameters()))
    if how == "remat":
        _remat_layers(spec, model)
    else:
        _hf_checkpointing(model, how == "hf-reentrant")
    expected = _backward(spec, reference, inp, 3)
    got = _backward(spec, model, inp, 3)
    assert got.keys() == expected.keys()
    assert_close(got, expected)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    if how != "hf-reentrant":  # torch.func: the frozen weights are taken from the module
        if how == "hf":
            model.disable_input_require_grads()
        trainable = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
        assert_close(_func_grad(spec, model, inp, trainable, 9), _func_grad(spec, reference, inp, trainable, 9))


def _recorded_loss(out):
    """A loss through every tensor HF's output recorder collected inside the layers."""
    loss = 0
    for key in ("attentions", "hidden_states", "router_logits", "encoder_attentions", "decoder_attentions",
                "cross_attentions", "encoder_hidden_states", "decoder_hidden_states"):
        for t in getattr(out, key, None) or ():
            if t is not None:
                loss = loss + t.square().mean()
    return loss + (out.aux_loss if getattr(out, "aux_loss", None) is not None else 0)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", ["mixtral", "qwen2", "bart", "roberta"])
def test_hf_checkpointing_differentiates_outputs_recorded_inside_the_layers(name, use_reentrant):
    """output_attentions, output_hidden_states and (Mixtral) output_router_logits, whose
    load-balancing loss is trained: HF collects them with forward hooks inside the checkpointed
    layers. They become outputs of the checkpointed calls, and their gradients flow as without
    checkpointing (train mode, dropout seeded alike)."""
    spec, reference, model, inp = _setup(name)
    calls = _hf_checkpointing(model, use_reentrant)
    flags = dict(output_attentions=True, output_hidden_states=True)
    if name == "mixtral":
        flags["output_router_logits"] = True
    results = []
    for m in (reference, model):
        m.set_attn_implementation("eager")  # (SDPA computes no attention weights to record)
        torch.manual_seed(3)
        out = m(**_kw(inp), **flags)
        assert getattr(out, "attentions", None) or getattr(out, "encoder_attentions", None)
        assert name != "mixtral" or out.aux_loss is not None
        (spec[1](out, inp) + _recorded_loss(out)).backward()
        results.append(_grads(m))
    assert calls
    assert_close(results[1], results[0])


def _moe(name):
    """Mixtures of experts whose routers HF's ``output_router_logits`` records (their eager experts)."""
    kw = dict(common_dec, num_key_value_heads=1, attention_dropout=0.0)
    if name == "qwen2_moe":
        config = C.Qwen2MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                  shared_expert_intermediate_size=8, decoder_sparse_step=1)
        cls = C.Qwen2MoeForCausalLM
    elif name == "olmoe":
        config, cls = C.OlmoeConfig(**kw, num_experts=4, num_experts_per_tok=2), C.OlmoeForCausalLM
    else:
        config, cls = C.GraniteMoeConfig(**kw, num_local_experts=4, num_experts_per_tok=2), C.GraniteMoeForCausalLM
    config._experts_implementation = "eager"
    return cls(config).to(D)


def _under(transform, loss, params, x):
    if transform == "grad":
        return tf.grad(lambda p: loss(p, x))(params)
    if transform == "vjp":
        value, pull = tf.vjp(lambda p: loss(p, x), params)
        return value, pull(torch.ones_like(value))
    return tf.vmap(tf.grad(lambda p, xi: loss(p, xi[None])), in_dims=(None, 0))(params, x)  # vmap(grad)


@pytest.mark.parametrize("how", ["remat", "hf"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap(grad)"])
def test_attentions_recorded_inside_remat_layers_are_differentiated_under_torch_func(transform, how):
    """``output_attentions`` with eager attention: HF's recorder (a forward hook on each layer's
    attention) keeps the attention weights computed inside the remat'd layer in its list. Under a
    torch.func transform the list gets the call's output standing for each (plain autograd points
    the very tensor at the call's node): values and gradients as without remat. Under ``vmap(grad)``
    a clear refusal that names the recorder."""
    torch.manual_seed(0)
    reference = build("qwen2", 0.0).train()
    reference.set_attn_implementation("eager")
    model = copy.deepcopy(reference)
    if how == "remat":
        _remat_layers(SPECS["qwen2"], model)
    else:
        calls = _hf_checkpointing(model, False)
        model.disable_input_require_grads()  # (HF's requires_grad_ on the embeddings: refused by torch.func)
    params = {n: p.detach() for n, p in reference.named_parameters()}
    x = ids(B, S)

    def loss(m):
        def f(p, xs):
            out = tf.functional_call(m, p, (), dict(input_ids=xs, output_attentions=True))
            assert out.attentions[0] is not None
            return sum(a.square().sum() for a in out.attentions) + out.logits.sum()

        return f

    if transform == "vmap(grad)":
        # (Where the recorded weights are also what the layer's graph saves, below the vmap remat cannot
        # tell them from the graph's own while its grad level lasts: refused, saying what to do.)
        with pytest.raises(funckpt.CheckpointError, match="(?s)transformers' output recorder.*output_attentions=True.*without output_attentions"):
            _under(transform, loss(model), params, x)
        return
    assert_close(_under(transform, loss(model), params, x), _under(transform, loss(reference), params, x))
    assert how == "remat" or calls


@pytest.mark.parametrize("transform", ["grad", "vjp"])
@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe", "granitemoe"])
def test_the_load_balancing_loss_of_remat_layers_is_trained_under_torch_func(name, transform):
    """``output_router_logits``: the auxiliary load-balancing loss is computed from router logits
    that HF's recorder kept, in a list outside the remat'd layer, from inside it; its gradient
    reaches the routers under torch.func as without remat. (Not vmap: HF's eager experts branch
    on the routing, without remat too.)"""
    if not hasattr(C, {"qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}.get(name, "GraniteMoeForCausalLM")):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    reference = _moe(name).train()
    model = _remat_layers(SPECS["qwen2"], copy.deepcopy(reference))
    params = {n: p.detach() for n, p in reference.named_parameters()}

    def loss(m):
        def f(p, xs):
            out = tf.functional_call(m, p, (), dict(input_ids=xs, labels=xs, output_router_logits=True))
            return out.loss + out.aux_loss

        return f

    x = ids(B, S)
    assert_close(_under(transform, loss(model), params, x), _under(transform, loss(reference), params, x))


@pytest.mark.parametrize("randomness", ["error", "different"])
@pytest.mark.parametrize("how", ["hf", "remat"])
@pytest.mark.parametrize("name", ["opt", "bart", "whisper"])
def test_vmap_grad_per_example(name, how, randomness):
    train = randomness != "error"
    spec, reference, model, inp = _setup(name, 0.1 if train else 0.0)
    if not train:
        reference.eval()
        model.eval()
    if how == "remat":
        _remat_layers(spec, model)
    else:
        _hf_checkpointing(model, False)
        model.disable_input_require_grads()
    params = {n: p.detach() for n, p in reference.named_parameters()}
    keys = [k for k in _kw(inp) if k != "attention_mask"]

    def per_example(m):
        def loss(p, *xs):
            return tf.functional_call(m, p, (), {k: x[None] for k, x in zip(keys, xs)}).logits.square().mean()

        torch.manual_seed(4)
        in_dims = (None,) + (0,) * len(keys)
        return tf.vmap(tf.grad(loss), in_dims=in_dims, randomness=randomness)(params, *(inp[k] for k in keys))

    assert_close(per_example(model), per_example(reference))


# ---------------------------------------------------------------------------
# Dropout on a non-contiguous tensor inside a remat'd call, under torch.func.grad
# ---------------------------------------------------------------------------


class _PermutedDropout(nn.Module):
    # Whisper's encoder: conv features permuted to (batch, time, channels), plus the
    # positions, then dropout on that non-contiguous sum.
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 16, 4, dtype=D))
        self.pos = nn.Parameter(torch.randn(4, 16, dtype=D))

    def forward(self, x):
        return F.dropout((x * self.w).permute(0, 2, 1) + self.pos, 0.5, training=True)


def test_dropout_on_a_permuted_tensor_torch_func_grad():
    """Under torch.func.grad, dropout's mask on a non-contiguous tensor differs from
    the one drawn outside the transform (functorch's own dropout kernel draws a
    contiguous noise, ATen's one laid out as the input: see funckpt/_draws.py). The
    un-remat'd module under grad draws the transform's mask; remat must draw the same,
    although its forward run executes below the transform."""
    torch.manual_seed(0)
    module = _PermutedDropout()
    wrapped = funckpt.remat(module)
    x = torch.randn(2, 16, 4, dtype=D)
    params = {n: p.detach() for n, p in module.named_parameters()}

    def grads(m):
        torch.manual_seed(0)
        return tf.grad(lambda p: tf.functional_call(m, p, (x,)).square().sum())(params)

    assert_close(grads(wrapped), grads(module))


@pytest.mark.parametrize("name", ["whisper", "bart"])
def test_remat_whole_encoder_returning_a_model_output(name):
    """A remat'd submodule returning a transformers ModelOutput, with nothing registered: funckpt
    flattens it as transformers registered it with torch's pytree (eval mode: no dropout)."""
    spec, reference, model, inp = _setup(name)
    reference.eval(), model.eval()
    model.model.encoder = funckpt.remat(model.model.encoder)
    assert_close(_backward(spec, model, inp, 5), _backward(spec, reference, inp, 5))
    params = {n: p.detach() for n, p in reference.named_parameters()}
    assert_close(_func_grad(spec, model, inp, params, 9), _func_grad(spec, reference, inp, params, 9))


def test_whisper_remat_whole_encoder_torch_func_grad_with_dropout():
    # the same as a user meets it: the whole Whisper encoder remat'd (it returns a
    # BaseModelOutput, which funckpt flattens as transformers registered it with torch)
    spec, reference, model, inp = _setup("whisper")
    model.model.encoder = funckpt.remat(model.model.encoder)
    assert_close(_backward(spec, model, inp, 5), _backward(spec, reference, inp, 5))
    params = {n: p.detach() for n, p in reference.named_parameters()}
    assert_close(_func_grad(spec, model, inp, params, 9), _func_grad(spec, reference, inp, params, 9))


@pytest.mark.parametrize("how", ["hf-reentrant", "hf", "remat"])
def test_recurrent_gemma_two_training_steps(how):
    """RecurrentGemma's recurrent blocks keep ``self.recurrent_states`` (None, then a tensor the call
    computes) on a layer across calls: from the second step the call reaches the first one's, whose
    graph the first backward freed. Two optimizer steps equal the model's without checkpointing."""
    if not hasattr(transformers, "RecurrentGemmaForCausalLM"):
        pytest.skip("no RecurrentGemma in this transformers")
    config = C.RecurrentGemmaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, lru_width=H, attention_window_size=4, conv1d_width=3,
        block_types=["recurrent", "recurrent", "attention"], pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    reference = C.RecurrentGemmaForCausalLM(config).to(D).train()
    model = copy.deepcopy(reference)
    calls = [None]
    if how == "remat":
        _remat_layers((None, None, lambda m: [m.model.layers]), model)
    else:
        calls = _hf_checkpointing(model, how == "hf-reentrant")
    inp = _lm()
    results = []
    for m in (reference, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            opt.zero_grad()
            loss = _clm_loss(m(**inp), inp)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        results.append((losses, m.state_dict(), opt.state_dict()["state"]))
    assert calls
    assert_close(results[1], results[0])


@pytest.mark.parametrize("route", ["remat(model)", "remat(model.model)"])
def test_dynamic_rope_with_sequences_growing_and_shrinking(route):
    """Llama with dynamic RoPE: its rotary embedding (HF's ``dynamic_rope_update``, used by
    hundreds of models) rebinds the ``inv_freq`` buffer and ``self.max_seq_len_cached`` when a
    sequence is longer than the cached one or back within the original length. remat of a region
    holding it recomputes from the state at the call, buffer and length alike: the gradients and
    the rotary state equal the model's without remat at each step."""
    config = C.LlamaConfig(**{**common_dec, "max_position_embeddings": 4}, num_key_value_heads=1,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    reference = C.LlamaForCausalLM(config).to(D)
    net = copy.deepcopy(reference)
    if route == "remat(model)":
        model = funckpt.remat(net)
    else:
        net.model = funckpt.remat(net.model)
        model = net
    for n in (10, 10, 3, 7):
        x = ids(B, n)
        for m in (reference, model):
            m.zero_grad()
            m(input_ids=x).logits.square().mean().backward()
        assert_close({k: p.grad for k, p in net.named_parameters()}, {k: p.grad for k, p in reference.named_parameters()})
        rotary, expected = net.model.rotary_emb, reference.model.rotary_emb
        assert_close(rotary.inv_freq, expected.inv_freq)
        assert int(rotary.max_seq_len_cached) == int(expected.max_seq_len_cached)


def _wav2vec2_with_spec_augment():
    config = C.Wav2Vec2Config(vocab_size=16, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                              conv_dim=[16, 16], conv_stride=[4, 2], conv_kernel=[8, 3], num_conv_pos_embeddings=4,
                              num_conv_pos_embedding_groups=2, mask_time_prob=0.5, mask_time_length=2, hidden_dropout=0.1,
                              attention_dropout=0.1, feat_proj_dropout=0.0, layerdrop=0.0)
    torch.manual_seed(0)
    return C.Wav2Vec2ForCTC(config).to(D).train()


def _spec_augment_step(model, x):
    np = pytest.importorskip("numpy")
    np.random.seed(0)  # HF draws the SpecAugment masks from numpy's global generator
    torch.manual_seed(0)
    model.zero_grad()
    loss = model(input_values=x).logits.square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_wav2vec2_spec_augment_remat_layers_and_whole_base_model():
    """Wav2Vec2 in training mode masks time steps (SpecAugment, ``mask_time_prob``) with masks
    drawn from numpy's global generator, in the base model's ``forward`` outside the encoder
    layers. remat of the layers replays their torch dropout and equals the model without remat;
    remat of the whole base model cannot replay numpy's draws, and its error says so and what to
    remat instead (the generic advice, passing the generator as an argument, does not apply)."""
    reference = _wav2vec2_with_spec_augment()
    x = torch.randn(B, 400, dtype=D)
    expected = _spec_augment_step(reference, x)
    layers = copy.deepcopy(reference)
    for i in range(len(layers.wav2vec2.encoder.layers)):
        layers.wav2vec2.encoder.layers[i] = funckpt.remat(layers.wav2vec2.encoder.layers[i])
    assert_close(_spec_augment_step(layers, x), expected)
    whole = copy.deepcopy(reference)
    whole.wav2vec2 = funckpt.remat(whole.wav2vec2)
    with pytest.raises(funckpt.CheckpointError, match="did not reproduce(.|\n)*numpy(.|\n)*remat their encoder layers"):
        _spec_augment_step(whole, x)


def test_rwkv_in_eval_mode_remat_whole_model_rescales_its_weights_once():
    """RWKV in evaluation mode (``rescale_every``) divides some of its weights in place under
    ``no_grad`` on its first call and sets ``layers_are_rescaled``, on the model, so that later
    calls do not. The whole RwkvModel remat'd (gradients in evaluation mode: an attribution of
    the logits to the inputs) recomputes from the weights and the flag as at the call: the same
    gradients, weights and flag as without remat, over the rescaling call and the next one."""
    if not hasattr(transformers, "RwkvForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no RwkvForCausalLM")
    torch.manual_seed(0)
    config = C.RwkvConfig(vocab_size=V, hidden_size=H, num_hidden_layers=4, attention_hidden_size=H, intermediate_size=32,
                          context_length=16, rescale_every=2, use_cache=False)
    reference = C.RwkvForCausalLM(config).to(D).eval()
    model = copy.deepcopy(reference)
    model.rwkv = funckpt.remat(model.rwkv)
    x = ids(B, S)
    for _ in range(2):
        for m in (reference, model):
            m.zero_grad()
            m(input_ids=x).logits.square().mean().backward()
        assert_close(_grads(model), _grads(reference))
        assert_close(dict(model.named_parameters()), dict(reference.named_parameters()))
        assert model.rwkv.layers_are_rescaled and reference.rwkv.layers_are_rescaled
