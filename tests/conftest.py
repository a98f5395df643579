import numpy as np
import pytest

from xserv.runtime import cuda_available

HAS_GPU = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test (seeded from the test name so a failure reproduces)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
