"""The benchmarks stay runnable (tiny settings: a smoke test; their figures come from BENCHMARKS.md)."""

from benchmarks import gpu, overhead


def test_gpu_benchmark_runs_in_its_small_configuration():
    report = gpu.run(small=True)
    for variant in gpu.variants(gpu.SMALL, gpu.torch.device("cpu")):
        assert f"`{variant}`" in report


def test_per_call_overhead_benchmark_runs():
    report = overhead.run(rounds=2)
    assert "overhead per call" in report and "torch.utils.checkpoint" in report


def test_loops_benchmark_counts_recomputation_against_the_optimum():
    from benchmarks import loops

    sweep = loops.recomputation(30, (2, 8))
    for measured, optimum in sweep.values():
        assert optimum <= measured <= optimum + 30  # at most the run from the last kept carry to the last step
