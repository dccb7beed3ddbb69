"""GPU tests: every test here is marked `gpu` and skipped where torch sees no CUDA device."""
import random

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def lib():
    """The kernel library on the current device (one per test module)."""
    from engine.cuda.library import KernelLibrary
    return KernelLibrary(torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture
def gen(request):
    """Seeds torch from the test's id: fresh inputs per test, the same on a rerun."""
    seed = random.Random(request.node.nodeid).getrandbits(32)
    torch.manual_seed(seed)
    return seed
