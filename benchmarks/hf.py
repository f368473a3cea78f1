"""A real model: step time of a Hugging Face Llama with its decoder layers checkpointed.

Nobody here wrote the model: ``transformers.LlamaForCausalLM`` from a small config (6
layers, width 64, 4 heads, 2 key-value heads, batch 2 of 32 tokens), random weights, CPU,
float32. Each decoder layer receives the hidden states, the causal mask, the rotary
position embeddings and more from the model, so it exercises what a toy block does not:
non-differentiable inputs (the mask, cos/sin), a module tree with its logger, HF's output
recorder. Variants, interleaved in each round, medians:

* ``.backward()`` without checkpointing, with HF's own gradient checkpointing (which calls
  ``torch.utils.checkpoint``, ``use_reentrant=False``), and with every layer ``remat``'d;
* ``torch.func.grad`` of the loss through ``functional_call``, without checkpointing and
  with every layer ``remat``'d (HF's checkpointing cannot run there).

    python -m benchmarks.hf
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
import torch.func as tf

from funckpt import remat

from . import overhead
from ._common import table

LAYERS, WIDTH, HEADS, TOKENS, BATCH = 6, 64, 4, 32, 2


def steps() -> dict[str, Callable[[], object]]:
    """name -> one gradient step."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=TOKENS,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (BATCH, TOKENS))
    hf_checkpointing = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the method's new name varies across versions)
        hf_checkpointing.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rematted = copy.deepcopy(base)
    layers = rematted.model.layers
    for i in range(len(layers)):
        layers[i] = remat(layers[i])

    def backward(model: torch.nn.Module) -> Callable[[], object]:
        return lambda: model(input_ids=ids, labels=ids).loss.backward()

    def func_grad(model: torch.nn.Module) -> Callable[[], object]:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return tf.functional_call(model, p, (), {"input_ids": ids, "labels": ids}).loss

        return lambda: tf.grad(loss)(params)

    return {
        ".backward(), no checkpointing": backward(base),
        ".backward(), HF gradient checkpointing (torch.utils.checkpoint)": backward(hf_checkpointing),
        ".backward(), every layer remat'd": backward(rematted),
        "torch.func.grad, no checkpointing": func_grad(base),
        "torch.func.grad, every layer remat'd": func_grad(rematted),
    }


def run(rounds: int = 20) -> str:
    med = overhead.measure(rounds, {name: ("", step) for name, step in steps().items()})
    torch_ckpt = med[".backward(), HF gradient checkpointing (torch.utils.checkpoint)"]
    rows = [[f"`{k}`", f"{v * 1e3:.2f}", f"{v / torch_ckpt:.2f}"] for k, v in med.items()]
    return "\n".join(
        [
            "## A real model: Hugging Face Llama, every decoder layer checkpointed (CPU proxy)",
            "",
            f"Command: `python -m benchmarks.hf`. `transformers.LlamaForCausalLM`, {LAYERS} layers, width {WIDTH},",
            f"{HEADS} heads, batch {BATCH} of {TOKENS} tokens, float32, random weights; one gradient step per",
            f"round, all variants interleaved, medians of {rounds} rounds. The layers take the causal mask and",
            "the rotary embeddings as non-differentiable inputs.",
            "",
            table(["variant", "step (ms)", "step / HF checkpointing"], rows),
        ]
    )


if __name__ == "__main__":
    print(run())
