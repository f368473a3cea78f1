"""remat'd blocks under DistributedDataParallel and FSDP2, two processes on gloo (CPU).

Each scenario trains a small residual model for two SGD steps on two ranks, each
rank holding half the batch, and compares the gradients and parameters with one
process training the same model *without remat* on the whole batch. Spawning
the processes costs seconds, so one pair of processes runs every scenario
(``results`` fixture) and each test reads its scenario's outcome.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from funckpt import CheckpointError, checkpoint, checkpoint_name, policies, remat

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

D = 8
WORLD = 2
BATCH = 8


class Block(nn.Module):
    calls = 0  # forward runs in this process, recomputations included

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.down(F.gelu(checkpoint_name(self.up(self.ln(x)), "up")))


class MethodBlock(Block):
    """remat of a bound method inside the block's own forward: runs while FSDP has gathered it."""

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return self.down(F.gelu(checkpoint_name(self.up(self.ln(x)), "up")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + remat(self._mlp)(x)


class Net(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).squeeze(-1)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D, generator=g, dtype=torch.double), torch.randn(BATCH, generator=g, dtype=torch.double)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 holds DTensor shards


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and their last gradients, gathered, by the un-wrapped names."""
    out = {}
    for name, p in model.named_parameters():
        while name.startswith("module."):  # (DDP's, and a module holding DDP as its "module")
            name = name.removeprefix("module.")
        out[name] = _full(p.detach())
        out[name + ".grad"] = _full(p.grad)
    return out


# --------------------------------------------------------------- scenarios


def _remat_blocks(model: Net, **options) -> Net:
    model.blocks = nn.Sequential(*(remat(b, **options) for b in model.blocks))
    return model


def _ddp(model: Net) -> nn.Module:
    return nn.parallel.DistributedDataParallel(_remat_blocks(model))


def _ddp_policy(model: Net) -> nn.Module:
    return nn.parallel.DistributedDataParallel(_remat_blocks(model, policy=policies.dots_saveable))


def _ddp_segments(model: Net) -> nn.Module:
    model.blocks = remat(model.blocks, segments=2)
    return nn.parallel.DistributedDataParallel(model)


def _remat_of_ddp_static(model: Net) -> nn.Module:
    """remat of the DDP module itself: DDP's forward (which, with ``static_graph``, schedules the
    first step's all-reduce from a node on its outputs) runs around the checkpointed model."""
    return remat(nn.parallel.DistributedDataParallel(model, static_graph=True))


def _remat_of_ddp_unused(model: Net) -> nn.Module:
    """... and with ``find_unused_parameters``, which walks the graph of DDP's outputs for the
    parameters used: the checkpointed call's node, whose inputs they are."""
    return remat(nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))


def _ddp_static_teacher(model: Net) -> nn.Module:
    """Blocks that keep a reference to a DDP model with ``static_graph`` (a teacher) outside their
    registries and do not call it: not entered, not refused as a DDP called inside them."""
    teacher = nn.parallel.DistributedDataParallel(Net().double(), static_graph=True)
    for block in model.blocks:
        object.__setattr__(block, "teacher", teacher)
    return _ddp(model)


class _CheckpointOfDDP(nn.Module):
    """``funckpt.checkpoint(ddp, x)``, torch.utils.checkpoint's call, around a DDP module."""

    def __init__(self, ddp: nn.Module) -> None:
        super().__init__()
        self.module = ddp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=False)


def _checkpoint_of_ddp_static(model: Net) -> nn.Module:
    return _CheckpointOfDDP(nn.parallel.DistributedDataParallel(model, static_graph=True))


def fully_shard(module: nn.Module) -> nn.Module:
    """FSDP2 on a CPU mesh: the gloo ranks hold CPU tensors even where a GPU is present
    (the default mesh would pick the GPU's device type and mix devices)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as shard

    return shard(module, mesh=init_device_mesh("cpu", (WORLD,)))


def _fsdp2(model: Net, **options) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule

    from funckpt._modules import Remat

    model = _remat_blocks(model, **options)
    for block in model.blocks:
        fully_shard(block)
        # A sharded wrapper is an instance of its block's class still (code finds layers by class).
        assert isinstance(block, Block) and isinstance(block, FSDPModule) and type(block).__mro__[2] is Remat
    fully_shard(model)
    return model


def _fsdp2_names(model: Net) -> nn.Module:
    return _fsdp2(model, policy=policies.save_only_these_names("up"))


def _fsdp2_method(model: Net) -> nn.Module:
    for block in model.blocks:
        block.__class__ = MethodBlock
        fully_shard(block)
    fully_shard(model)
    return model


def _fsdp2_back_reference(model: Net) -> nn.Module:
    """Blocks that keep a reference to the model they sit in, outside its registries: the walk of a
    block does not enter the model (whose other blocks, sharded, it would refuse as called)."""
    for block in model.blocks:
        object.__setattr__(block, "root", model)
    return _fsdp2(model)


def _fsdp2_sharded_teacher(model: Net) -> nn.Module:
    """Blocks that keep a reference to another sharded model (a teacher, an EMA copy) outside their
    registries and do not call it: not entered, not refused as called in them."""
    teacher = Net().double()
    for block in teacher.blocks:
        fully_shard(block)
    fully_shard(teacher)
    for block in model.blocks:
        object.__setattr__(block, "teacher", teacher)
    return _fsdp2(model)


def _fsdp2_remat_of_sharded(model: Net) -> nn.Module:
    """The other order, remat(fully_shard(block)): FSDP's hooks run around the checkpointed forward,
    and fully_shard(model) leaves the parameters the wrappers share with the blocks to them."""
    for block in model.blocks:
        fully_shard(block)
    model.blocks = nn.Sequential(*(remat(b) for b in model.blocks))
    fully_shard(model)
    return model


class CheckpointingNet(Net):
    """torch.utils.checkpoint's call on each (sharded) block, from the model's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x).squeeze(-1)


def _fsdp2_checkpoint_of_sharded(model: Net) -> nn.Module:
    model.__class__ = CheckpointingNet
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


SCENARIOS: dict[str, Callable[[Net], nn.Module]] = {
    "ddp": _ddp,
    "ddp_policy": _ddp_policy,
    "ddp_segments": _ddp_segments,
    "remat_of_ddp_static": _remat_of_ddp_static,
    "remat_of_ddp_unused": _remat_of_ddp_unused,
    "checkpoint_of_ddp_static": _checkpoint_of_ddp_static,
    "ddp_static_teacher": _ddp_static_teacher,
    "fsdp2": _fsdp2,
    "fsdp2_names": _fsdp2_names,
    "fsdp2_method": _fsdp2_method,
    "fsdp2_back_reference": _fsdp2_back_reference,
    "fsdp2_sharded_teacher": _fsdp2_sharded_teacher,
    "fsdp2_remat_of_sharded": _fsdp2_remat_of_sharded,
    "fsdp2_checkpoint_of_sharded": _fsdp2_checkpoint_of_sharded,
}
# Block forwards over two steps of four blocks: each remat'd block runs twice a
# step (remat of an nn.Sequential checkpoints every segment, the last included).
BLOCK_CALLS = dict.fromkeys(SCENARIOS, 16)


def _sharded_modules_inside_remat_are_refused() -> list[str]:
    """A sharded block called inside a remat'd function (not remat'd itself), and fully_shard'ed
    layers inside a remat'd nn.Sequential."""
    x = torch.randn(2, D, dtype=torch.double)
    messages = []
    seq = remat(nn.Sequential(Block(), Block()).double(), segments=2)
    for layer in seq:
        fully_shard(layer)
    sharded = fully_shard(Block().double())
    for program in (lambda: remat(lambda x: sharded(x).exp())(x), lambda: seq(x)):
        try:
            program()
            messages.append("no error")
        except CheckpointError as e:
            messages.append(str(e))
    return messages


def _ddp_reached_inside_remat_is_refused() -> list[str]:
    """A DDP module that prepares its reduction from its outputs' graph, called inside a remat'd
    function (not remat'd itself): refused before DDP's forward runs, not reduced wrongly."""
    x = torch.randn(2, D, dtype=torch.double)
    messages = []
    for options in ({"static_graph": True}, {"find_unused_parameters": True}):
        ddp = nn.parallel.DistributedDataParallel(Net().double(), **options)
        try:
            remat(lambda x, ddp=ddp: ddp(x).exp())(x)
            messages.append("no error")
        except CheckpointError as e:
            messages.append(str(e))
    return messages


def _worker(rank: int, store: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        x, y = _data()
        torch.manual_seed(0)
        reference = Net().double()
        initial = {k: v.clone() for k, v in reference.state_dict().items()}
        _train(reference, x, y)
        expected = _state(reference)
        for name, build in SCENARIOS.items():
            try:
                model = Net().double()
                model.load_state_dict(initial)
                wrapped = build(model)
                Block.calls = 0
                _train(wrapped, x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
                assert Block.calls == BLOCK_CALLS[name], f"{Block.calls} block forwards, not {BLOCK_CALLS[name]}"
                got = _state(wrapped)
                assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
                for key in expected:
                    torch.testing.assert_close(got[key], expected[key], msg=lambda m, k=key: f"{k}: {m}")
                results[(name, rank)] = "ok"
            except Exception:
                results[(name, rank)] = traceback.format_exc()
        results[("refused", rank)] = _sharded_modules_inside_remat_are_refused()
        results[("ddp_refused", rank)] = _ddp_reached_inside_remat_is_refused()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    store = tmp_path_factory.mktemp("dist") / "store"
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(str(store), shared), nprocs=WORLD, join=True)
        return dict(shared)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_with_remat_match_one_process_without(results, scenario):
    for rank in range(WORLD):
        assert results[(scenario, rank)] == "ok", results[(scenario, rank)]


def test_a_sharded_module_called_inside_a_remat_d_function_says_which_order_works(results):
    for rank in range(WORLD):
        for message in results[("refused", rank)]:
            assert "fully_shard(remat(block))" in message


def test_ddp_preparing_from_its_outputs_inside_a_remat_d_function_says_what_to_checkpoint(results):
    for rank in range(WORLD):
        for message in results[("ddp_refused", rank)]:
            assert "Checkpoint the DDP module itself (remat(ddp)" in message, message
