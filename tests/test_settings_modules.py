"""The small modules that hold one setting each: btlib.paths, btlib._version, btlib.quick, btlib.kernels.gpu_limits.

paths.data_file looks in $BTLIB_DATA_DIR, then the checkout's data/, and says where it looked; _version matches
pyproject.toml; quick_mode reads BTLIB_QUICK; gpu_limits' numbers match the CUDA header and the registry entries
they feed (a limit quoted in two places that drifts apart is what this file catches).
"""

import math
import re
import tomllib
from pathlib import Path

import pytest
import torch

import btlib
from btlib import _version, paths, quick
from btlib.kernels import get, gpu_limits

ROOT = Path(__file__).resolve().parent.parent


def test_data_file_prefers_the_env_dir_then_the_checkout(tmp_path, monkeypatch):
    (tmp_path / "sentences.txt").write_text("mine\n")
    monkeypatch.setenv("BTLIB_DATA_DIR", str(tmp_path))
    assert paths.data_file("sentences.txt") == tmp_path / "sentences.txt"
    # A file the env dir lacks comes from the checkout's data/.
    assert paths.data_file("tutorial_batches.json") == ROOT / "data" / "tutorial_batches.json"
    monkeypatch.delenv("BTLIB_DATA_DIR")
    assert paths.data_file("sentences.txt") == ROOT / "data" / "sentences.txt"


def test_missing_data_file_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("BTLIB_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="BTLIB_DATA_DIR") as e:
        paths.data_file("no_such_file.json")
    assert str(tmp_path) in str(e.value) and str(ROOT / "data") in str(e.value)


def test_version_is_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _version.__version__ == btlib.__version__ == project["version"]


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("", False),
                                             ("quick", False)])
def test_quick_mode_reads_btlib_quick(monkeypatch, value, expected):
    monkeypatch.setenv("BTLIB_QUICK", value)
    assert quick.quick_mode() is expected


def test_gpu_limits_match_the_cuda_header_and_the_registry():
    assert gpu_limits.LOG2E == math.log2(math.e)
    header = (ROOT / "btlib/kernels/cuda/flash_attn.h").read_text()
    assert int(re.search(r"constexpr int kMaxHeadDim = (\d+);", header).group(1)) == gpu_limits.MAX_HEAD_DIM
    source = (ROOT / "btlib/kernels/cuda/flash_attn.cu").read_text()
    assert f"head_dim must be in [1, {gpu_limits.MAX_HEAD_DIM}]" in source  # the binding's message quotes the limit
    assert set(gpu_limits.DTYPES) == {torch.float16, torch.bfloat16, torch.float32}
    for name in ("triton_flash", "triton_flash_varlen", "cuda_flash", "cuda_flash_varlen"):
        assert get(name).max_head_dim == gpu_limits.MAX_HEAD_DIM and get(name).dtypes == gpu_limits.DTYPES


def test_cpu_limits_quoted_in_python_match_core_h():
    from btlib import blocks
    from btlib.kernels.cpu import ops, schema

    core = (ROOT / "btlib/kernels/cpu/core.h").read_text()
    value = {name: int(re.search(rf"constexpr int64_t {name} = (\d+);", core).group(1)) for name in ("Br", "Bc", "kMaxD")}
    assert ops.MAX_HEAD_DIM == schema.MAX_HEAD_DIM == value["kMaxD"]  # "# kMaxD in core.h"
    assert (blocks.Br, blocks.Bc) == (value["Br"], value["Bc"])  # "# the C++ kernels' tile (core.h)"
