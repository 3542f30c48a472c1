"""GPU tests for the pytest plugin, run by integrations_gpu.py as
``pytest -p snapshot_lab.pytest_plugin --snaplab-max-peak 1GiB gpu_limit_tests.py``:
one test within its limit, one over it (fails, naming the line that allocated and keeping a
snapshot and report), one unmarked under the global limit."""

import pytest
import torch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.limit_cuda_memory("256 MiB")
def test_within_its_limit():
    x = torch.randn(1024, 1024, device="cuda")  # 4 MiB
    assert (x @ x).shape == (1024, 1024)


@pytest.mark.limit_cuda_memory("256 MiB")
def test_over_its_limit():
    chunks = [torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(6)]  # 384 MiB
    assert len(chunks) == 6


@needs_gpu
def test_unmarked_under_the_global_limit():
    x = torch.ones(32 * 2**20, dtype=torch.uint8, device="cuda")  # 32 MiB, under --snaplab-max-peak 1GiB
    assert int(x.sum()) == 32 * 2**20
