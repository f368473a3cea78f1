"""Parameter-efficient fine-tuning: frozen base weights, trainable adapters.

The workload users report most false errors on. Tiny HuggingFace models (random
init, nothing downloaded) in float64 get LoRA adapters: written by hand (a
wrapper around each attention/MLP projection holding the frozen ``base`` and
trainable ``A``/``B``, with dropout on the adapter's input and a scaling), as a
``torch.nn.utils.parametrize`` parametrization (minLoRA's pattern), over
int8-stored frozen weights (QLoRA-like), and through ``peft`` where installed.
The embeddings are frozen, so the first layer's input does not require grad.

Every result is compared with the same model run without checkpointing. The
routes: HF's ``gradient_checkpointing_enable()`` routed to ``funckpt.checkpoint``
(``use_reentrant`` True and False, as HF passes it, with and without
``enable_input_require_grads``), ``funckpt.remat(layer)`` in the layer list (with
policies), ``.backward()``, ``torch.func.grad`` of the adapters only through
``functional_call`` (base weights passed as constants), and per-example
``vmap(grad)`` of the adapters.
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
import torch.nn.utils.parametrize as parametrize  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import funckpt  # noqa: E402
from funckpt import CheckpointError, policies  # noqa: E402

transformers.logging.set_verbosity_error()

D = torch.float64
V, H = 64, 16
B, S = 2, 8
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


# ---------------------------------------------------------------------------
# Adapters and frozen weights
# ---------------------------------------------------------------------------


def _features(base):
    if isinstance(base, Conv1D):  # GPT-2's projection: weight is (in, out)
        return base.weight.shape[0], base.nf
    return base.in_features, base.out_features


class LoRALinear(nn.Module):
    """``base(x) + scaling * B(A(dropout(x)))``, the base frozen; ``merge()`` folds the
    adapter into the base weight in place, ``unmerge()`` takes it out again."""

    def __init__(self, base, r=4, alpha=8, dropout=0.0):
        super().__init__()
        self.base = base
        n_in, n_out = _features(base)
        # B is not zero (as it would be at initialization) so that A gets a gradient too
        self.A = nn.Parameter(torch.randn(r, n_in, dtype=D) * 0.1)
        self.B = nn.Parameter(torch.randn(n_out, r, dtype=D) * 0.1)
        self.drop = nn.Dropout(dropout)
        self.scaling = alpha / r
        self.merged = False

    def forward(self, x):
        y = self.base(x)
        if not self.merged:
            a = funckpt.checkpoint_name(self.drop(x) @ self.A.t(), "lora_a")
            y = y + funckpt.checkpoint_name(a @ self.B.t() * self.scaling, "lora_out")
        return y

    def _delta(self):
        delta = self.B @ self.A * self.scaling
        return delta.t() if isinstance(self.base, Conv1D) else delta

    @torch.no_grad()
    def merge(self):
        self.base.weight += self._delta()
        self.merged = True

    @torch.no_grad()
    def unmerge(self):
        self.base.weight -= self._delta()
        self.merged = False


class Int8Linear(nn.Module):
    """A frozen Linear stored as int8 with a float scale per row, dequantized in forward.

    ``as_parameter``: the int8 weight is a ``Parameter`` with requires_grad=False (as
    bitsandbytes stores its quantized weights) rather than a buffer.
    """

    def __init__(self, linear, as_parameter=False):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        q = torch.round(w / scale).to(torch.int8)
        if as_parameter:
            self.qweight = nn.Parameter(q, requires_grad=False)
        else:
            self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        return F.linear(x, self.qweight.to(x.dtype) * self.scale)


class LowRankDelta(nn.Module):
    """LoRA as a parametrization of ``weight``: ``W + B @ A``."""

    def __init__(self, n_out, n_in, r=4):
        super().__init__()
        self.A = nn.Parameter(torch.randn(r, n_in, dtype=D) * 0.1)
        self.B = nn.Parameter(torch.randn(n_out, r, dtype=D) * 0.1)

    def forward(self, w):
        return w + self.B @ self.A


def _replace(model, targets, make):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, (nn.Linear, Conv1D)):
                setattr(module, name, make(child))


def _freeze_all_but_adapters(model):
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".A", ".B")))
    return model


def _llama(dropout=0.0, tie=False):
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, attention_dropout=dropout,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).to(D)


def _gpt2(dropout=0.0):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=H, n_layer=2, n_head=2, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, bos_token_id=0, eos_token_id=0, use_cache=False,
    )
    return transformers.GPT2LMHeadModel(cfg).to(D)


def lora_model(arch="llama", dropout=0.1, quantized=None, seed=0):
    """A tiny model with every attention/MLP projection wrapped in a LoRALinear; only
    the adapters train (the embeddings are frozen). ``quantized``: None, "buffer" or
    "parameter" (the frozen base stored as int8, see Int8Linear)."""
    torch.manual_seed(seed)
    model = _llama() if arch == "llama" else _gpt2()
    targets = LLAMA_TARGETS if arch == "llama" else GPT2_TARGETS

    def make(linear):
        base = linear if quantized is None else Int8Linear(linear, as_parameter=quantized == "parameter")
        return LoRALinear(base, dropout=dropout)

    _replace(model, targets, make)
    return _freeze_all_but_adapters(model).train()


def layers_of(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


# ---------------------------------------------------------------------------
# Routes, losses, gradients
# ---------------------------------------------------------------------------


def hf_checkpointing(model, use_reentrant, checkpoint_fn=funckpt.checkpoint):
    """HF's gradient checkpointing with ``checkpoint_fn`` as the function HF binds;
    returns the list of calls. HF itself also registers ``enable_input_require_grads``'s
    hook when the input embeddings are frozen (PEFT's case)."""
    model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
    calls = []

    def routed(function, *args, **kwargs):
        calls.append(function)
        return checkpoint_fn(function, *args, **kwargs)

    modules = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert modules
    for m in modules:
        m._gradient_checkpointing_func = functools.partial(routed, use_reentrant=use_reentrant)
    return calls


def remat_layers(model, policy=None):
    layers = layers_of(model)
    for i in range(len(layers)):
        layers[i] = funckpt.remat(layers[i], policy=policy)
    return model


ROUTES = {
    "hf_reentrant": lambda m: hf_checkpointing(m, True),
    "hf_non_reentrant": lambda m: hf_checkpointing(m, False),
    "remat": remat_layers,
}
POLICIES = {
    "dots_saveable": policies.dots_saveable,
    "save_only_these_names": policies.save_only_these_names("lora_a", "lora_out"),
    "memory_budget": policies.memory_budget(0.5),
}


def checkpointed(model, route):
    """A deep copy of ``model`` checkpointed by ``route`` (a ROUTES key or a POLICIES key for remat)."""
    model = copy.deepcopy(model)
    if route in POLICIES:
        remat_layers(model, POLICIES[route])
    else:
        ROUTES[route](model)
    return model


def for_torch_func(model, route):
    """HF's enable registers a forward hook calling requires_grad_() on the embeddings'
    output, which torch.func refuses (and does not need): taken off under torch.func."""
    model = checkpointed(model, route)
    if route.startswith("hf"):
        model.disable_input_require_grads()
    return model


def ids(seed=0, batch=B):
    return torch.randint(1, V, (batch, S), generator=torch.Generator().manual_seed(seed))


IDS = ids()


def lm_loss(model, input_ids=IDS):
    logits = model(input_ids=input_ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, V), input_ids[:, 1:].reshape(-1))


def trainable_grads(model):
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values()), "an adapter got no gradient"
    return grads


def backward_grads(model, seed=5, input_ids=IDS):
    torch.manual_seed(seed)
    lm_loss(model, input_ids).backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "a frozen weight got a gradient"
    return trainable_grads(model)


def adapters_and_frozen(model):
    """The trainable parameters, and every other tensor of the model (a shared adapter
    is passed once, under its first name)."""
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    frozen, seen = {}, set(trainable)
    for n, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            frozen[n] = t.detach()
    return adapters, frozen


def adapter_grad(model, frozen):
    """torch.func.grad of the loss with respect to the adapters only; the base weights
    (and buffers, int8 ones included) passed to functional_call as constants."""
    return tf.grad(lambda a: lm_loss_functional(model, {**frozen, **a}, IDS))


def lm_loss_functional(model, tensors, input_ids):
    logits = tf.functional_call(model, tensors, (), dict(input_ids=input_ids)).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, V), input_ids[:, 1:].reshape(-1))


def per_example_adapter_grads(model, randomness, seed=3):
    adapters, frozen = adapters_and_frozen(model)

    def loss(a, x):
        return lm_loss_functional(model, {**frozen, **a}, x[None])

    torch.manual_seed(seed)
    return tf.vmap(tf.grad(loss), in_dims=(None, 0), randomness=randomness)(adapters, IDS)


# ---------------------------------------------------------------------------
# 1. .backward(): every route, both architectures, adapter dropout on
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", [*ROUTES, *POLICIES])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_backward(arch, route):
    reference = lora_model(arch)
    model = checkpointed(reference, route)
    expected = backward_grads(reference)
    assert_close(backward_grads(model), expected)
    # the dropout on the adapters' input is really on: another seed, other gradients
    name = next(iter(expected))
    assert not torch.allclose(backward_grads(copy.deepcopy(reference), seed=6)[name], expected[name])


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("input_require_grads", [True, False])
def test_hf_enable_input_require_grads_pattern(use_reentrant, input_require_grads):
    """With frozen embeddings the first layer's input does not require grad; PEFT calls
    ``enable_input_require_grads()`` because torch's reentrant checkpoint would then give
    the adapters no gradient. funckpt gives the right gradients with the hook or without."""
    reference = lora_model()
    model = copy.deepcopy(reference)
    calls = hf_checkpointing(model, use_reentrant)
    if input_require_grads:
        model.enable_input_require_grads()
    else:
        model.disable_input_require_grads()
    assert_close(backward_grads(model), backward_grads(reference))
    assert len(calls) == 2


def test_torch_reentrant_checkpoint_without_the_hook_loses_adapter_gradients():
    """Why the pattern above exists (torch's behaviour, which funckpt does not copy):
    with only adapters inside the layers training, the loss does not even require grad."""
    model = lora_model()
    hf_checkpointing(model, True, torch.utils.checkpoint.checkpoint)
    model.disable_input_require_grads()
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        loss = lm_loss(model)
    assert not loss.requires_grad


# ---------------------------------------------------------------------------
# 2. torch.func: grad of the adapters only, per-example gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", [*ROUTES, "dots_saveable"])
def test_torch_func_grad_of_adapters_only(route):
    reference = lora_model(dropout=0.0)
    model = for_torch_func(reference, route)
    adapters, frozen = adapters_and_frozen(reference)
    expected = adapter_grad(reference, frozen)(adapters)
    assert_close(adapter_grad(model, frozen)(adapters), expected)
    assert_close(expected, backward_grads(copy.deepcopy(reference)))


@pytest.mark.parametrize("randomness", ["eval", "different", "same"])
@pytest.mark.parametrize("route", ["hf_non_reentrant", "remat"])
def test_per_example_adapter_grads_vmap(route, randomness):
    """DP-SGD style: vmap(grad) of the adapters, in eval mode or with adapter dropout
    drawn per example (``randomness='different'``) or once for the batch."""
    reference = lora_model(dropout=0.2)
    if randomness == "eval":
        reference.eval()
    model = for_torch_func(reference, route)
    mode = "error" if randomness == "eval" else randomness
    expected = per_example_adapter_grads(reference, mode)
    assert_close(per_example_adapter_grads(model, mode), expected)
    if randomness == "eval":  # sanity of the reference: they average to the batch's gradient
        adapters, frozen = adapters_and_frozen(reference)
        assert_close({k: g.mean(0) for k, g in expected.items()}, adapter_grad(reference, frozen)(adapters))


# ---------------------------------------------------------------------------
# 3. QLoRA-like: the frozen base stored as int8
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["buffer", "parameter"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_int8_frozen_base(route, storage):
    reference = lora_model(quantized=storage)
    int8 = [t for t in reference.state_dict().values() if t.dtype == torch.int8]
    assert len(int8) == 14
    assert_close(backward_grads(checkpointed(reference, route)), backward_grads(copy.deepcopy(reference)))
    reference.eval()
    model = for_torch_func(reference, route)
    adapters, frozen = adapters_and_frozen(reference)
    assert_close(adapter_grad(model, frozen)(adapters), adapter_grad(reference, frozen)(adapters))
    assert_close(per_example_adapter_grads(model, "error"), per_example_adapter_grads(reference, "error"))


# ---------------------------------------------------------------------------
# 4. Shared weights
# ---------------------------------------------------------------------------


def _shared(kind):
    torch.manual_seed(0)
    base = _llama(tie=kind == "tied_embeddings")
    if kind == "shared_mlp":  # one MLP (base and adapters) used by both layers
        base.model.layers[1].mlp = base.model.layers[0].mlp
    _replace(base, LLAMA_TARGETS, lambda linear: LoRALinear(linear, dropout=0.1))
    if kind == "shared_adapter":  # the same A in two layers, over different base weights
        base.model.layers[1].self_attn.q_proj.A = base.model.layers[0].self_attn.q_proj.A
    model = _freeze_all_but_adapters(base)
    if kind == "tied_embeddings":  # the tied embedding/lm_head weight trains too
        model.model.embed_tokens.weight.requires_grad_(True)
    return model.train()


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("kind", ["shared_mlp", "shared_adapter", "tied_embeddings"])
def test_shared_weights(kind, route):
    reference = _shared(kind)
    model = checkpointed(reference, route)
    assert_close(backward_grads(model), backward_grads(reference))
    if kind != "tied_embeddings":
        model = for_torch_func(reference, route)
        adapters, frozen = adapters_and_frozen(reference)
        torch.manual_seed(1)
        expected = adapter_grad(reference, frozen)(adapters)
        torch.manual_seed(1)
        assert_close(adapter_grad(model, frozen)(adapters), expected)


# ---------------------------------------------------------------------------
# 5. What happens between the forward and the backward pass
# ---------------------------------------------------------------------------


def _lora_modules(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


@pytest.mark.parametrize("route", list(ROUTES))
def test_merging_adapters_between_forward_and_backward_raises(route):
    """Merging writes the base weights the recomputation needs: a clear CheckpointError.
    (Merging and unmerging again does not restore them bit for bit, and PyTorch itself
    refuses that one: the base weights are saved for the input's gradient.)"""
    for unmerge in (False, True):
        model = checkpointed(lora_model(), route)
        loss = lm_loss(model)
        for m in _lora_modules(model):
            m.merge()
        if unmerge:
            for m in _lora_modules(model):
                m.unmerge()
        with pytest.raises(CheckpointError, match="modified in place between the forward and the backward"):
            loss.backward()
    reference = lora_model()
    loss = lm_loss(reference)
    for m in _lora_modules(reference):
        m.merge()
        m.unmerge()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("route", list(ROUTES))
def test_merged_evaluation_between_steps(route):
    """Merge for a no_grad evaluation after a step, unmerge, train on: as without checkpointing."""
    reference = lora_model()
    model = checkpointed(reference, route)
    for m in (reference, model):
        backward_grads(m)
        for lora in _lora_modules(m):
            lora.merge()
        m.eval()
        with torch.no_grad():
            lm_loss(m, ids(1))
        m.train()
        for lora in _lora_modules(m):
            lora.unmerge()
        backward_grads(m, seed=9, input_ids=ids(2))
    assert_close(trainable_grads(model), trainable_grads(reference))


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_grad_evaluation_between_forward_and_backward(route):
    """An evaluation (eval mode, then train mode with dropout drawing) between a
    step's forward and its backward: the recomputation replays the step's own masks."""
    reference = lora_model(dropout=0.2)
    model = checkpointed(reference, route)
    for m in (reference, model):
        torch.manual_seed(5)
        loss = lm_loss(m)
        m.eval()
        with torch.no_grad():
            lm_loss(m, ids(1))
        m.train()
        with torch.no_grad():
            lm_loss(m, ids(2))
        loss.backward()
    assert_close(trainable_grads(model), trainable_grads(reference))


@pytest.mark.parametrize("route", list(ROUTES))
def test_eval_mode_left_on_until_backward(route):
    """``model.eval()`` between the forward and the backward: the recomputation runs
    in the training mode of the forward pass (dropout included), as the graph of the
    model without checkpointing does, and the model is left in eval mode."""
    for dropout in (0.0, 0.2):
        reference = lora_model(dropout=dropout)
        model = checkpointed(reference, route)
        for m in (reference, model):
            torch.manual_seed(5)
            loss = lm_loss(m)
            m.eval()
            loss.backward()
            assert not any(sub.training for sub in m.modules())
        assert_close(trainable_grads(model), trainable_grads(reference))


@pytest.mark.parametrize("route", list(ROUTES))
def test_training_in_eval_mode(route):
    reference = lora_model(dropout=0.2).eval()
    assert_close(backward_grads(checkpointed(reference, route)), backward_grads(reference))


@pytest.mark.parametrize("route", list(ROUTES))
def test_gradient_accumulation_and_retain_graph(route):
    """Two micro-batches' graphs alive at once, backward in reverse order, the second
    one twice (retain_graph)."""
    reference = lora_model(dropout=0.2)
    model = checkpointed(reference, route)
    for m in (reference, model):
        torch.manual_seed(5)
        first, second = lm_loss(m, ids(1)) / 2, lm_loss(m, ids(2)) / 2
        second.backward(retain_graph=True)
        second.backward()
        first.backward()
    assert_close(trainable_grads(model), trainable_grads(reference))


@pytest.mark.parametrize("route", list(ROUTES))
def test_partially_frozen_norms(route):
    """Norm weights train too, except the first layer's input norm (frozen)."""
    reference = lora_model()
    for name, p in reference.named_parameters():
        if "norm" in name:
            p.requires_grad_("layers.0.input_layernorm" not in name)
    assert_close(backward_grads(checkpointed(reference, route)), backward_grads(reference))


@pytest.mark.parametrize("route", list(ROUTES))
def test_requires_grad_changed_after_the_forward(route):
    """As in PyTorch: a parameter frozen after the forward gets no gradient (AccumulateGrad
    skips it); one unfrozen after the forward gets none either (it is not in the graph)."""
    reference = lora_model()
    model = checkpointed(reference, route)
    grads = []
    for m in (reference, model):
        torch.manual_seed(5)
        loss = lm_loss(m)
        named = dict(m.named_parameters())
        named["model.layers.0.self_attn.q_proj.A"].requires_grad_(False)
        named["model.layers.1.mlp.down_proj.base.weight"].requires_grad_(True)
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert grads[0]["model.layers.0.self_attn.q_proj.A"] is None
    assert grads[0]["model.layers.1.mlp.down_proj.base.weight"] is None
    assert grads[1].keys() == grads[0].keys()
    for name, g in grads[0].items():
        if g is None:
            assert grads[1][name] is None, name
        else:
            assert_close(grads[1][name], g)


@pytest.mark.parametrize("route", list(ROUTES))
def test_gradients_of_some_adapters_only(route):
    reference = lora_model()
    model = checkpointed(reference, route)
    results = []
    for m in (reference, model):
        a_only = [p for n, p in m.named_parameters() if n.endswith(".A")]
        torch.manual_seed(5)
        results.append(torch.autograd.grad(lm_loss(m), a_only))
        torch.manual_seed(5)
        lm_loss(m).backward(inputs=a_only)
        assert all(p.grad is None for n, p in m.named_parameters() if n.endswith(".B"))
    assert_close(results[1], results[0])
    a_grads = [{n: p.grad for n, p in m.named_parameters() if n.endswith(".A")} for m in (model, reference)]
    assert all(g is not None for g in a_grads[1].values())
    assert_close(a_grads[0], a_grads[1])


# ---------------------------------------------------------------------------
# 6. LoRA as a parametrization, with parametrize.cached()
# ---------------------------------------------------------------------------


def _parametrized_lora_model():
    torch.manual_seed(0)
    model = _llama()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in LLAMA_TARGETS:
                parametrize.register_parametrization(child, "weight", LowRankDelta(*child.weight.shape))
    return _freeze_all_but_adapters(model).train()


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("route", list(ROUTES))
def test_parametrized_lora(route, cached):
    """Under ``parametrize.cached()`` each weight is computed once and kept in torch's
    global cache: from inside a checkpointed layer that used to be refused as an
    escaped tensor (a false CheckpointError)."""
    reference = _parametrized_lora_model()
    # built again rather than deep-copied: torch's cached() gives other gradients for a
    # deepcopy of a model whose parametrized modules were copied together
    model = _parametrized_lora_model()
    ROUTES[route](model)

    def grads(m):
        with parametrize.cached() if cached else torch.enable_grad():
            loss = lm_loss(m)
        loss.backward()
        return trainable_grads(m)

    assert_close(grads(model), grads(reference))
    if route.startswith("hf"):
        model.disable_input_require_grads()
    adapters, frozen = adapters_and_frozen(reference)

    def func_grad(m):
        def loss(a):
            with parametrize.cached() if cached else torch.enable_grad():
                return lm_loss_functional(m, a, IDS)

        return tf.grad(loss)(adapters)

    assert_close(func_grad(model), func_grad(reference))


# ---------------------------------------------------------------------------
# 6b. Adapters kept outside the model, applied by hooks
# ---------------------------------------------------------------------------


def _hooked_adapters(model, store):
    """LoRA on each layer's q_proj and v_proj, and a steering vector on each layer's MLP input, all
    kept outside the model (``store``: name -> tensor) and applied by forward hooks and pre-hooks on
    modules inside the layers, with dropout on the adapter's input (pyreft's and steering's way)."""
    for i, layer in enumerate(layers_of(model)):
        for proj in ("q_proj", "v_proj"):
            def lora(module, args, out, key=f"{i}.{proj}"):
                a = F.dropout(args[0], 0.1, module.training) @ store[key + ".A"].t()
                return out + a @ store[key + ".B"].t() * 2.0
            getattr(layer.self_attn, proj).register_forward_hook(lora)
        layer.mlp.register_forward_pre_hook(lambda module, args, key=f"{i}.steer": (args[0] + store[key],))


def _hooked_adapter_tensors():
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(2):
        for proj in ("q_proj", "v_proj"):
            tensors[f"{i}.{proj}.A"] = torch.randn(4, H, dtype=D, generator=g) * 0.1
            tensors[f"{i}.{proj}.B"] = torch.randn(H // 2 if proj == "v_proj" else H, 4, dtype=D, generator=g) * 0.1
        tensors[f"{i}.steer"] = torch.randn(H, dtype=D, generator=g) * 0.1
    return tensors


@pytest.mark.parametrize("route", ["hf_non_reentrant", "remat"])
def test_adapters_applied_by_hooks_from_outside_the_model(route):
    """The adapters' tensors are reached only through the hooks of modules inside the checkpointed
    layers: they get the gradients they get without checkpointing, under ``.backward()`` (adapter
    dropout seeded alike) and under ``torch.func.grad`` of a function that puts its input in the
    store the hooks read (a false CheckpointError before: the hooks were not walked)."""
    torch.manual_seed(0)
    base = _llama().train()
    for p in base.parameters():
        p.requires_grad_(False)
    values = _hooked_adapter_tensors()
    results = []
    for checkpointed_model in (False, True):
        model = copy.deepcopy(base)
        store = {k: v.clone().requires_grad_() for k, v in values.items()}
        _hooked_adapters(model, store)
        if checkpointed_model:
            ROUTES[route](model)
        torch.manual_seed(5)
        lm_loss(model).backward()
        by_autograd = {k: v.grad for k, v in store.items()}
        if route.startswith("hf"):
            model.disable_input_require_grads()

        def loss(adapters):
            store.update(adapters)
            return lm_loss(model)

        torch.manual_seed(5)
        results.append((by_autograd, tf.grad(loss)(values)))
    assert all(g is not None for g in results[0][0].values())
    assert_close(results[1], results[0])


# ---------------------------------------------------------------------------
# 7. peft (skipped where it is not installed)
# ---------------------------------------------------------------------------


def _peft_model(dora=False, dropout=0.1):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False, use_dora=dora,
    )
    return peft.get_peft_model(_llama(), config).train()


def _peft_checkpointed(reference, route, input_require_grads=True):
    model = copy.deepcopy(reference)
    inner = model.base_model.model
    if route == "remat":
        remat_layers(inner)
    else:
        ROUTES[route](inner)
        if input_require_grads:
            model.enable_input_require_grads()  # as PEFT's prepare_model_for_kbit_training does
        else:  # torch.func refuses the hook (see for_torch_func)
            inner.disable_input_require_grads()
    return model


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("route", list(ROUTES))
def test_peft_lora_backward(route, dora):
    reference = _peft_model(dora=dora)
    model = _peft_checkpointed(reference, route)
    expected = backward_grads(reference)
    assert len(expected) == (18 if dora else 12)  # A, B (and DoRA's magnitude) x 3 targets x 2 layers
    assert_close(backward_grads(model), expected)


def test_peft_lora_on_remat_projections():
    """PEFT chooses its target layers by class: a remat'd ``q_proj`` (an ``nn.Linear`` to
    ``isinstance``) gets its adapter as the plain one does, outside the checkpointed call."""
    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    base = _llama()
    remat_projections = copy.deepcopy(base)
    for layer in layers_of(remat_projections):
        layer.self_attn.q_proj = funckpt.remat(layer.self_attn.q_proj)
    models = []
    for m in (base, remat_projections):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(m, peft.LoraConfig(**config)).train())
    reference, model = models
    assert_close(backward_grads(model), backward_grads(reference))


@pytest.mark.parametrize("route", ["hf_non_reentrant", "remat"])
def test_peft_lora_torch_func(route):
    reference = _peft_model(dropout=0.0)
    model = _peft_checkpointed(reference, route, input_require_grads=False)
    adapters, frozen = adapters_and_frozen(reference)
    assert_close(adapter_grad(model, frozen)(adapters), adapter_grad(reference, frozen)(adapters))
    reference.eval()
    model.eval()
    assert_close(per_example_adapter_grads(model, "error"), per_example_adapter_grads(reference, "error"))


def test_peft_merge_and_disable_adapter_around_steps():
    """merge_adapter()/unmerge_adapter() for an evaluation after a step, and an evaluation
    with the adapters disabled between a step's forward and backward."""
    reference = _peft_model()
    model = _peft_checkpointed(reference, "hf_non_reentrant")
    for m in (reference, model):
        torch.manual_seed(5)
        loss = lm_loss(m)
        with m.disable_adapter(), torch.no_grad():
            lm_loss(m, ids(1))
        loss.backward()
        m.merge_adapter()
        with torch.no_grad():
            lm_loss(m, ids(1))
        m.unmerge_adapter()
        backward_grads(m, seed=6, input_ids=ids(2))
    assert_close(trainable_grads(model), trainable_grads(reference))
