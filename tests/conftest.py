"""Fixtures shared by several test files."""

import os
import sys
from pathlib import Path

import pytest
from background import _background_runs, background_run, readers_last, waited  # noqa: F401 - a fixture

# s3_server / s3: a SeaweedFS S3 server on 127.0.0.1 (per session); ray_cluster: a two-node Ray cluster.
# _background_runs: the long runs some tests read, started when the session begins (tests/background.py).
pytest_plugins = ["s3_support", "ray_support"]


@pytest.fixture
def cuda_device():
    """The device of the `cuda`-marked tests (tests/test_cuda.py): a CUDA GPU, else the test is skipped with
    the reason. `HYPE_CUDA_TESTS_DEVICE=cpu` runs them on the CPU instead: `bench/gpu_suite.py --smoke` does,
    so that the GPU's tests run in every CI and cannot rot between the rare GPU runs."""
    import torch

    forced = os.environ.get("HYPE_CUDA_TESTS_DEVICE")
    if forced:
        return torch.device(forced)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (bench/gpu_suite.py runs these on one: README 'GPU checks')")
    return torch.device("cuda")


# The demo's small sizes (tests/test_demo.py, tests/test_workflow.py): `hype demo` options and the same
# values as `hype run demo` variables.
DEMO_OPTIONS = [
    "--size", "300", "--clean-size", "300", "--eval-size", "40", "--scorer-samples", "256",
    "--subset-samples", "128", "--num-clusters", "8", "--no-progress",
]  # fmt: skip
DEMO_VARS = [
    "size=300", "clean_size=300", "eval_size=40", "scorer_samples=256", "subset_samples=128",
    "num_clusters=8", "references=150",
]  # fmt: skip


@background_run("demo_run", timeout=900)
def _demo_command(folder: Path) -> list[str]:
    return [sys.executable, "-m", "hype.cli", "demo", "--out", str(folder / "demo"), *DEMO_OPTIONS]


@pytest.fixture(scope="session")
def demo_run(request):
    """One `hype demo` at the small sizes (Ray scoring, every step), made once per session in the background
    (tests/background.py): test_demo checks it and its resume, test_workflow's kill test compares its
    interrupted runs with it. (its folder, its completed process)"""
    folder, done = waited(request, "demo_run")
    return folder / "demo", done


def pytest_collection_modifyitems(items):
    readers_last(items)
