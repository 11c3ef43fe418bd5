"""Without triton (macOS, Windows, Linux aarch64: no wheels), btlib and notebook 05's CPU parts still import and say why."""

import importlib.util
import os
import subprocess
import sys

import pytest

# Makes `import triton` fail in the child process as it does where triton is not installed.
BLOCK = """
import importlib.util, sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'triton':
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split('.')[0] == 'triton' else _find(name, *a, **k)
"""

CHILD = BLOCK + """
import os
os.environ["TRITON_INTERPRET"] = "1"  # what notebook 05 sets before its imports
import torch, btlib
from btlib import bench
from btlib.kernels import get
from btlib.kernels.cuda import build, emulate  # notebook 05's imports
from btlib.kernels.triton import flash_attn
assert "triton" not in sys.modules
assert flash_attn.TRITON_MISSING and not flash_attn.interpreted()
print(sorted(flash_attn.block_config(80, torch.float16, 75).items()))
try:
    flash_attn.flash_attention(*torch.randn(3, 1, 1, 4, 16))
    raise AssertionError("launched without triton")
except RuntimeError as e:
    assert "Linux x86_64 only" in str(e), e
assert "Linux x86_64 only" in get("triton_flash").supports(torch.empty(1, 1, 1, 64))
out = btlib.attention(*torch.randn(3, 1, 2, 5, 16))  # auto skips the Triton kernels
rows = bench.run(bench.load_all()["gpu_attention"], quick=True, save=False)
assert rows and all(r["status"] != "wrong" for r in rows)
assert all(r["status"] == "skipped" for r in rows if r["provider"].startswith("triton"))
print("ok")
"""


def test_flash_attn_imports_and_explains_without_triton():
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
    if importlib.util.find_spec("triton") is not None:  # the same tiles as with the real triton.next_power_of_2
        code = "import torch; from btlib.kernels.triton.flash_attn import block_config as b; print(sorted(b(80, torch.float16, 75).items()))"
        real = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"})
        assert res.stdout.splitlines()[0] == real.stdout.strip(), real.stderr[-2000:]


def test_stand_ins_compute_like_triton_and_refuse_to_launch():
    from btlib.kernels.triton import _no_triton

    t = _no_triton.triton
    assert [t.cdiv(a, 16) for a in (0, 1, 15, 16, 17, 97)] == [0, 1, 1, 1, 2, 7]
    for n in range(1, 300):
        p = t.next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and p // 2 < n, n  # the smallest power of two >= n
    kernel = t.jit(lambda x: x)
    for launch in (lambda: kernel[(1,)](0), lambda: kernel(0)):
        with pytest.raises(RuntimeError, match="Linux x86_64 only"):
            launch()
