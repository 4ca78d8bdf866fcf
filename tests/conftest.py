import os

import pytest
import torch

# Reference numerics were produced with one CPU thread; more threads change
# float summation order (~1e-6 relative), which is inside every tolerance anyway.
torch.set_num_threads(int(os.environ.get("COSYSERVE_TEST_THREADS", "2")))


def pytest_addoption(parser):
    parser.addoption("--soak", type=float, default=20.0, metavar="SECONDS",
                     help="duration of the reliability soak test (8 concurrent streams on the demo model; "
                          "default 20 s in CI, docs/reliability.md reports a 600 s run)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """The test runs on one torch thread: the reference data were computed so, and with one thread
    the float summation order is the same, so exact equality can be observed (tolerances do not
    depend on it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_tf32():
    """CUDA matmuls and convolutions in full float32 (no TF32) for the test (parity on the GPU)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Each test leaves the root logger as it found it: an in-process ``cosyserve serve`` installs its
    handler and INFO level (``setup_logging``), which would print engine logs into a later CLI test's
    captured stderr."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
