import os

import pytest
import torch

from tests.support.teardown_filter import install_if_triton_loaded

# Tests never touch a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One torch CPU thread per module (many tiny ops: on a shared 2-core box OpenMP barrier stalls
    cost ~10 ms per bmm). Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_unconfigure(config):
    """Triton's nanobind leak report at interpreter exit is not ours to print (teardown_filter.py)."""
    install_if_triton_loaded()
