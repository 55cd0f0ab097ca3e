"""Fixtures shared by several test files."""

import os
import subprocess
import sys

import pytest

# s3_server / s3: a SeaweedFS S3 server on 127.0.0.1 (per session); ray_cluster: a two-node Ray cluster.
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


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """One `hype demo` at the small sizes (Ray scoring, every step), made once per session: test_demo
    checks it and its resume, test_workflow's kill test compares its interrupted runs with it."""
    out = tmp_path_factory.mktemp("demo-run") / "demo"
    cmd = [sys.executable, "-m", "hype.cli", "demo", "--out", str(out), *DEMO_OPTIONS]
    return out, subprocess.run(cmd, capture_output=True, text=True, timeout=900)
