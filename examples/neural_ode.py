"""A Neural ODE fitted to a spiral, differentiated through hundreds of RK4 steps.

The classic example of torchdiffeq's ``ode_demo.py``: the data is a spiral, the
solution of ``dz/dt = (z ** 3) @ A`` from ``z0 = (2, 0)``; the model is a small MLP
``f(z ** 3)`` integrated with fixed-step RK4 and fitted so its trajectory matches.
Backpropagating through the solver keeps every step's internals, so memory grows
with the number of steps; ``funckpt.fori_loop(..., checkpoints=c)`` keeps at most
``c`` states and recomputes the rest by Griewank and Walther's binomial schedule.

The script first measures the peak memory of one training step through the
whole trajectory (plain loop, ``checkpoints=8``), then trains with
``checkpoints=8`` and prints the loss. A minute or two on 2 CPU cores::

    python examples/neural_ode.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._common, run from anywhere

import funckpt
from benchmarks._common import peak_bytes

STEPS, DT, BATCH = 400, 0.025, 16
A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])


def rk4(f, z, dt):
    k1 = f(z)
    k2 = f(z + dt / 2 * k1)
    k3 = f(z + dt / 2 * k2)
    k4 = f(z + dt * k3)
    return z + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def spiral() -> torch.Tensor:
    """The true trajectory, ``STEPS + 1`` points."""
    z, points = torch.tensor([[2.0, 0.0]]), []
    with torch.no_grad():
        for _ in range(STEPS + 1):
            points.append(z[0])
            z = rk4(lambda z: (z**3) @ A, z, DT)
    return torch.stack(points)


class ODEFunc(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z**3)


def loss_fn(func: ODEFunc, z0: torch.Tensor, targets: torch.Tensor, checkpoints: int | None, plain: bool = False):
    """Integrate each start point for ``targets.shape[0]`` steps; the mean distance to the true points on the way."""

    def body(i, carry):
        z, total = carry
        z = rk4(func, z, DT)
        return z, total + (z - targets[i]).abs().mean()

    carry = (z0, torch.zeros(()))
    if plain:
        for i in range(targets.shape[0]):
            carry = body(i, carry)
    else:
        carry = funckpt.fori_loop(0, targets.shape[0], body, carry, checkpoints=checkpoints)
    return carry[1] / targets.shape[0]


def batch(true: torch.Tensor, length: int, generator: torch.Generator):
    """``BATCH`` random start points on the true trajectory, and the ``length`` points after each."""
    starts = torch.randint(0, STEPS - length, (BATCH,), generator=generator)
    z0 = true[starts]
    targets = torch.stack([true[starts + i + 1] for i in range(length)])  # (length, BATCH, 2)
    return z0, targets


def main(iterations: int = 300, measure: bool = True) -> float:
    """Measure one step's memory, train, and return the final whole-trajectory loss."""
    torch.manual_seed(0)
    true = spiral()
    func = ODEFunc()
    g = torch.Generator().manual_seed(0)

    # Peak memory of one step through the whole trajectory: what the schedule saves.
    z0, targets = true[:1], true[1:].unsqueeze(1)
    print(f"peak memory of one training step through {STEPS} RK4 steps:" if measure else "", end="")
    for name, kwargs in [] if not measure else [
        ("plain Python loop", {"checkpoints": None, "plain": True}),
        ("fori_loop, checkpoints=8", {"checkpoints": 8}),
    ]:
        start = time.perf_counter()
        peak = peak_bytes(lambda kwargs=kwargs: loss_fn(func, z0, targets, **kwargs).backward())
        func.zero_grad()
        print(f"  {name:30s} {peak / 2**20:7.2f} MiB  ({time.perf_counter() - start:.1f} s)")

    # Train on windows of 10 steps, then of 100, keeping at most 8 states.
    optimizer = torch.optim.Adam(func.parameters(), lr=5e-3)
    start = time.perf_counter()
    with torch.no_grad():
        full = loss_fn(func, true[:1], true[1:].unsqueeze(1), checkpoints=None)
    print(f"before training: whole-trajectory loss {full.item():.4f}")
    for iteration in range(1, iterations + 1):
        length = 10 if iteration <= 2 * iterations // 3 else 100
        z0, targets = batch(true, length, g)
        optimizer.zero_grad()
        loss = loss_fn(func, z0, targets, checkpoints=8)
        loss.backward()
        optimizer.step()
        if iteration % 50 == 0:
            with torch.no_grad():
                full = loss_fn(func, true[:1], true[1:].unsqueeze(1), checkpoints=None)
            print(f"iteration {iteration:3d}  window loss {loss.item():.4f}  whole-trajectory loss {full.item():.4f}")
    print(f"trained in {time.perf_counter() - start:.0f} s")
    with torch.no_grad():
        return loss_fn(func, true[:1], true[1:].unsqueeze(1), checkpoints=None).item()


if __name__ == "__main__":
    main()
