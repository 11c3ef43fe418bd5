import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_saved_rows(monkeypatch):
    """Unit tests run benchmarks too; only the notebooks' rows belong in `make test`'s summary."""
    monkeypatch.delenv("BTLIB_RESULTS_DIR", raising=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
