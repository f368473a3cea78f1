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

    python -m benchmarks.hf                 # on the CPU (BENCHMARKS.md)
    python -m benchmarks.hf --device cuda   # on a GPU: a launch-bound real model (.ci/gpu bench)
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


def steps(device: torch.device = torch.device("cpu")) -> dict[str, Callable[[], object]]:
    """name -> one gradient step (that waits for the device to finish it)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=TOKENS,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config).to(device).train()
    ids = torch.randint(0, 128, (BATCH, TOKENS), device=device)
    hf_checkpointing = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the method's new name varies across versions)
        hf_checkpointing.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rematted = copy.deepcopy(base)
    layers = rematted.model.layers
    for i in range(len(layers)):
        layers[i] = remat(layers[i])

    def finished(step: Callable[[], object]) -> Callable[[], object]:
        if device.type != "cuda":
            return step

        def synchronized() -> object:
            out = step()
            torch.cuda.synchronize(device)
            return out

        return synchronized

    def backward(model: torch.nn.Module) -> Callable[[], object]:
        return finished(lambda: model(input_ids=ids, labels=ids).loss.backward())

    def func_grad(model: torch.nn.Module) -> Callable[[], object]:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return tf.functional_call(model, p, (), {"input_ids": ids, "labels": ids}).loss

        return finished(lambda: tf.grad(loss)(params))

    return {
        ".backward(), no checkpointing": backward(base),
        ".backward(), HF gradient checkpointing (torch.utils.checkpoint)": backward(hf_checkpointing),
        ".backward(), every layer remat'd": backward(rematted),
        "torch.func.grad, no checkpointing": func_grad(base),
        "torch.func.grad, every layer remat'd": func_grad(rematted),
    }


def run(rounds: int = 20, device: torch.device = torch.device("cpu")) -> str:
    med = overhead.measure(rounds, {name: ("", step) for name, step in steps(device).items()})
    torch_ckpt = med[".backward(), HF gradient checkpointing (torch.utils.checkpoint)"]
    rows = [[f"`{k}`", f"{v * 1e3:.2f}", f"{v / torch_ckpt:.2f}"] for k, v in med.items()]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU proxy"
    return "\n".join(
        [
            f"## A real model: Hugging Face Llama, every decoder layer checkpointed ({where})",
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
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--rounds", type=int, default=20)
    arguments = parser.parse_args()
    print(run(arguments.rounds, torch.device(arguments.device)))
