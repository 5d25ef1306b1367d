"""Smoke test of benchmarks/bench_gpu.py, prepared for a machine with a GPU: its --quick run on the
CPU prints every table, with a passing extraction, so the script is ready when a device is."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


@pytest.mark.slow
def test_the_gpu_benchmark_runs_its_quick_cpu_pass_and_prints_every_table():
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for title in ("### Throughput", "### Extraction", "### Projection"):
        assert title in out
    extraction = [line for line in out.splitlines() if line.startswith("| 32 | 2 | cpu |")]
    assert len(extraction) == 1 and extraction[0].rstrip().endswith("| ok | - |")
    throughput = [line for line in out.splitlines() if line.startswith(("| 64 | 4 |", "| 256 | 8 |"))]
    assert len(throughput) == 6  # two sizes, three dtypes


@pytest.mark.slow
def test_without_a_gpu_the_full_run_says_how_to_run_it():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full run would start")
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--quick" in run.stderr and "no CUDA device" in run.stderr
