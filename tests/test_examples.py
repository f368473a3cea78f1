"""The examples run (tiny settings: a smoke test, not a benchmark)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(capsys):
    load("quickstart").main(depth=2, width=32, batch=16)
    assert "equal torch.func.grad's: yes" in capsys.readouterr().out


def test_per_example_grads(capsys):
    load("per_example_grads").main(depth=2, width=8, examples=3, length=4)
    out = capsys.readouterr().out
    assert "fails" in out and "equal the plain ones: yes" in out


@pytest.mark.parametrize("flags", [[], ["--policy", "dots"], ["--no-remat"]])
def test_train_gpt(flags, capsys):
    tiny = ["--steps", "3", "--layers", "1", "--width", "16", "--heads", "2", "--context", "8", "--batch", "2", "--sample", "5"]
    result = load("train_gpt").main(tiny + flags)
    assert result["first_loss"] > 0 and "peak memory of one step" in capsys.readouterr().out


def test_neural_ode_trains_through_a_checkpointed_loop(capsys):
    final = load("neural_ode").main(iterations=6, measure=False)
    out = capsys.readouterr().out
    assert "before training" in out and final == final  # a number, not NaN
