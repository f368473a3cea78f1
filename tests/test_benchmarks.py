"""The benchmarks stay runnable (tiny settings: a smoke test; their figures come from BENCHMARKS.md)."""

from benchmarks import gpu, overhead


def test_gpu_benchmark_runs_in_its_small_configuration():
    report = gpu.run(small=True)
    for variant in gpu.variants(gpu.SMALL, gpu.torch.device("cpu")):
        assert f"`{variant}`" in report


def test_per_call_overhead_benchmark_runs():
    report = overhead.run(rounds=2)
    assert "overhead per call" in report and "torch.utils.checkpoint" in report


def test_real_model_benchmark_runs():
    from benchmarks import hf

    report = hf.run(rounds=1)
    assert "every layer remat'd" in report and "HF gradient checkpointing" in report


def test_loops_benchmark_counts_recomputation_against_the_optimum():
    from benchmarks import loops

    sweep = loops.recomputation(30, (2, 8))
    for measured, optimum in sweep.values():
        assert measured == optimum


def test_slow_benchmarks_write_blocks_that_benchmarks_run_keeps(tmp_path):
    from benchmarks._common import kept_blocks, write_block

    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nother sections\n")
    write_block("python -m benchmarks.budget --write", "## first", path)
    write_block("python -m benchmarks.budget --write", "## second", path)
    write_block("python -m benchmarks.loops --write", "## loops", path)
    text = path.read_text()
    assert text.count("<!-- begin: python -m benchmarks.budget --write -->") == 1
    assert "## second" in text and "## first" not in text
    assert kept_blocks(text) == [
        "<!-- begin: python -m benchmarks.budget --write -->\n## second\n<!-- end: python -m benchmarks.budget --write -->",
        "<!-- begin: python -m benchmarks.loops --write -->\n## loops\n<!-- end: python -m benchmarks.loops --write -->",
    ]


def test_instruction_count_benchmark_steps_run_without_valgrind():
    """The steps its children count under callgrind run as plain steps (the counts come from BENCHMARKS.md)."""
    from benchmarks import instructions

    for variant in instructions.TINY + instructions.GPT + instructions.SAVING:
        instructions.child(variant, rounds=1)
