"""Train a small GPT on Python's own standard library, functionally, with every block remat'd.

The training loop is written the way torch.func users write them: the model's
parameters are a plain dict of tensors, the loss is a pure function of them
(``torch.func.functional_call``), ``torch.func.grad_and_value`` differentiates
it, and the optimizer is a pure function too: ``adamw_step(params, grads,
state) -> (params, state)`` on dicts of tensors. Nothing is hidden in module or
optimizer objects, so the whole step could be vmapped, nested in another grad,
or checkpointed; and ``torch.utils.checkpoint`` cannot be used under
``torch.func.grad`` at all, which is where ``funckpt.remat`` comes in.

Text: the ``.py`` files of the standard library of the Python running this
script, read as bytes (vocabulary 256): nothing is downloaded.

    python examples/train_gpt.py                      # about two minutes on 2 CPU cores
    python examples/train_gpt.py --policy dots --steps 100
    python examples/train_gpt.py --no-remat
"""

from __future__ import annotations

import argparse
import glob
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.func as tf
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import peak_bytes  # noqa: E402

from funckpt import checkpoint_name, policies, remat  # noqa: E402

POLICIES = {
    "nothing": policies.nothing_saveable,
    "dots": policies.dots_saveable,
    "dots-no-batch": policies.dots_with_no_batch_dims_saveable,
    "names": policies.save_only_these_names("attention"),
    "everything": policies.everything_saveable,
}


# ----------------------------------------------------------------------------- data


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's Python sources as one byte tensor."""
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    data = bytearray()
    for path in files:
        data += Path(path).read_bytes() + b"\n"
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(corpus) - context - 1, (batch,), generator=generator)
        window = torch.stack([corpus[s : s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with dropout and a residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attention = checkpoint_name(attention, "attention")  # for --policy names
        x = x + F.dropout(self.proj(attention.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, context: int, dropout: float, policy) -> None:
        super().__init__()
        self.token = nn.Embedding(256, width)
        self.position = nn.Embedding(context, width)
        blocks = [Block(width, heads, dropout) for _ in range(layers)]
        # remat(block) is an nn.Module with the block's parameters under the same names.
        self.blocks = nn.ModuleList([remat(b, policy=policy) if policy is not None else b for b in blocks])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ----------------------------------------------------- a functional optimizer (AdamW)


def adamw_init(params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "m": {k: torch.zeros_like(v) for k, v in params.items()},
        "v": {k: torch.zeros_like(v) for k, v in params.items()},
        "t": {"": torch.zeros(())},
    }


@torch.no_grad()
def adamw_step(params, grads, state, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """One AdamW step as a pure function: new parameters and state, inputs untouched."""
    t = state["t"][""] + 1
    b1, b2 = betas
    m = {k: b1 * state["m"][k] + (1 - b1) * grads[k] for k in params}
    v = {k: b2 * state["v"][k] + (1 - b2) * grads[k].square() for k in params}
    scale = lr * math.sqrt(1 - b2 ** t.item()) / (1 - b1 ** t.item())
    new = {
        k: params[k] * (1 - lr * weight_decay * (params[k].dim() > 1)) - scale * m[k] / (v[k].sqrt() + eps)
        for k in params
    }
    return new, {"m": m, "v": v, "t": {"": t}}


# ----------------------------------------------------------------------------- main


def make_loss(model: GPT):
    def loss_fn(params, tokens, targets):
        logits = tf.functional_call(model, params, (tokens,))
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    return loss_fn


@torch.no_grad()
def sample(model: GPT, params, prompt: bytes, length: int, context: int, generator: torch.Generator) -> str:
    model.eval()
    tokens = torch.tensor(list(prompt))[None]
    for _ in range(length):
        logits = tf.functional_call(model, params, (tokens[:, -context:],))[0, -1]
        probs = torch.softmax(logits / 0.8, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)[None]], dim=1)
    model.train()
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def sparkline(values: list[float], width: int = 40) -> str:
    bars = "▁▂▃▄▅▆▇█"
    step = max(1, len(values) // width)
    points = [sum(values[i : i + step]) / len(values[i : i + step]) for i in range(0, len(values), step)]
    lo, hi = min(points), max(points)
    return "".join(bars[int((p - lo) / (hi - lo + 1e-9) * (len(bars) - 1))] for p in points)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="nothing")
    parser.add_argument("--no-remat", action="store_true", help="train without checkpointing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--sample", type=int, default=200, help="bytes of text to sample at the end")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    corpus = load_corpus(max_bytes=2_000_000)
    policy = None if args.no_remat else POLICIES[args.policy]
    dims = (args.layers, args.width, args.heads, args.context, args.dropout)
    model = GPT(*dims, policy=policy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = adamw_init(params)
    step_fn = tf.grad_and_value(make_loss(model))
    data = batches(corpus, args.batch, args.context, torch.Generator().manual_seed(args.seed))

    print(
        f"{len(corpus) / 1e6:.1f} MB of standard-library source, {sum(v.numel() for v in params.values()) / 1e6:.2f}M "
        f"parameters, {'no remat' if policy is None else f'remat per block, policy {args.policy}'}"
    )
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="training", ncols=90)
    for i in bar:
        tokens, targets = next(data)
        lr = args.lr * min(1.0, (i + 1) / 20)  # short warm-up
        grads, loss = step_fn(params, tokens, targets)
        params, state = adamw_step(params, grads, state, lr)
        losses.append(loss.item())
        rate = (i + 1) * tokens.numel() / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")

    # Peak memory of one training step, with and without remat, side by side.
    tokens, targets = next(data)
    peaks = {}
    for name, p in (("without remat", None), ("with remat", policy or policies.nothing_saveable)):
        m = GPT(*dims, policy=p)
        step = tf.grad_and_value(make_loss(m))
        step(params, tokens, targets)
        peaks[name] = peak_bytes(lambda: step(params, tokens, targets))
    first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    print(f"loss: {first:.3f} {sparkline(losses)} {last:.3f}  (mean of the first and last 10 steps)")
    print(
        f"peak memory of one step: {peaks['without remat'] / 2**20:.1f} MiB without remat, "
        f"{peaks['with remat'] / 2**20:.1f} MiB with remat "
        f"({peaks['with remat'] / peaks['without remat']:.2f}x)"
    )
    if args.sample:
        text = sample(model, params, b"def ", args.sample, args.context, torch.Generator().manual_seed(args.seed))
        print("sample:\n" + text)
    return {"first_loss": first, "last_loss": last, **{f"peak {k}": v for k, v in peaks.items()}}


if __name__ == "__main__":
    main()
