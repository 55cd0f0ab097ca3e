"""Fixtures shared by several test files."""

import os

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
