"""btlib/kernels/_build.py, the one build path: each build once per process, a failure remembered with its reason.

The broken-compiler test runs in a subprocess (CXX is read when a build starts, and a remembered failure
lives for the process) with an empty TORCH_EXTENSIONS_DIR, so the shared cache is never touched.
"""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from btlib import quant
from btlib.kernels import _build
from btlib.kernels.cpu import build

# Answers the version probes cpp_extension makes (-v, -dumpfullversion) and fails every compile (-c),
# logging each one: the test counts compiles, not probes.
BROKEN_CXX = """#!/bin/sh
case " $* " in
  *" -c "*) echo "$*" >> "$0.log"; echo "broken c++: error: this compiler fails every build (btlib test)" >&2; exit 1;;
esac
echo "gcc version 12.2.0"
"""

CODE = r"""
import json, warnings, torch
from btlib import quant
from btlib.kernels.cpu import build
out = {}
for key in ("first", "second"):
    try:
        build.load()
    except RuntimeError as e:
        out[key] = str(e)
out["available"] = build.available()
g = torch.Generator().manual_seed(0)
x, w, b = torch.randn(7, 32, generator=g), torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
lin = quant.Int8Linear(w, b, activation="gelu")
with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
    warnings.simplefilter("always")
    ys = [lin(x) for _ in range(3)]
    quant.kernels.cache_clear()  # past quant's own cache: the remembered failure answers, not a compile
    ys.append(lin(x))
    ref = lin._forward_torch(x)
out["warnings"] = [str(c.message) for c in caught if "int8" in str(c.message)]
out["same"] = all(torch.equal(y, ref) for y in ys)
out["int8_available"] = build.int8_available()
print(json.dumps(out))
"""


def test_a_failed_build_is_tried_once_and_reported_with_the_compilers_words(tmp_path):
    cxx = tmp_path / "c++"
    cxx.write_text(BROKEN_CXX)
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CXX": str(cxx), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    why = "broken c++: error: this compiler fails every build (btlib test)"
    compiles = (tmp_path / "c++.log").read_text().splitlines()
    assert len(compiles) == 2  # the attention library once and int8.cpp once, though each was asked for again
    assert "attention.cpp" in compiles[0] and "int8.cpp" in compiles[1]
    assert r.stderr.count("compiling the C++ attention kernels") == 1 and r.stderr.count("compiling the int8 helpers") == 1
    assert why in out["first"] and "falls back to PyTorch's kernels" in out["first"]  # the whole compiler message
    assert "unavailable" in out["second"] and why in out["second"]  # the remembered reason, no compile
    assert out["available"].startswith("building the C++ attention kernels") and why in out["available"]
    assert len(out["warnings"]) == 1  # one warning for four forwards, not one (and one compile) per forward
    assert why in out["warnings"][0] and "torch ops" in out["warnings"][0]
    assert out["same"]  # int8 gave the torch-ops arithmetic, bit for bit
    assert why in out["int8_available"]


@pytest.mark.skipif(build.int8_available() is not None, reason=f"int8.cpp cannot build here: {build.int8_available()}")
def test_the_normal_int8_build_loads_once_and_matches_torch_ops():
    k = quant.kernels()
    assert k is not None and k is build.int8_module()  # the module, built (or loaded from the cache) once
    assert build._int8.attempts.get(f"btlib_int8_{build.isa()}", 0) <= 1
    g = torch.Generator().manual_seed(0)
    lin = quant.Int8Linear(torch.randn(40, 96, generator=g), torch.randn(40, generator=g), activation="relu")
    x = torch.randn(97, 96, generator=g)
    with torch.inference_mode():
        fused, plain = lin(x), lin._forward_torch(x)
    # the same arithmetic; x * (1 / s) in C++ against x / s in torch can round a value to the next int8 step:
    # one step of one term is |w_n s_m| <= max|y| / 127 or so, far below 1% of the output's scale
    assert (fused - plain).abs().max() <= 0.01 * plain.abs().max()


@pytest.mark.skipif(build.available() is not None, reason=f"C++ kernels cannot build here: {build.available()}")
def test_the_normal_attention_build_loads_once():
    info = build.load()
    assert build.load() is info and build.available() is None
    assert build._ext.attempts.get(f"btlib_cpu_attention_{build.isa()}", 0) <= 1


def test_first_errors_keeps_the_compilers_error_lines():
    message = ("Error building extension 'btlib_int8_avx512': [1/2] c++ -MMD -MF int8.o.d -O3 -c int8.cpp -o int8.o\n"
               "FAILED: int8.o\nc++ -MMD -MF int8.o.d -O3 -c int8.cpp -o int8.o\n"
               "int8.cpp: In function 'void f()':\nint8.cpp:3:1: error: 'foo' does not name a type\n    3 | foo bar;\n"
               "int8.cpp:9:2: error: expected ';' before '}' token\nninja: build stopped: subcommand failed.\n")
    assert _build.first_errors(message) == ("int8.cpp:3:1: error: 'foo' does not name a type\n"
                                            "int8.cpp:9:2: error: expected ';' before '}' token")
    assert _build.first_errors("Error building extension 'x': linker died\nld: cannot find -lgomp", 1) == "ld: cannot find -lgomp"


def test_a_failure_not_remembered_is_tried_again_and_one_remembered_is_not(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the announcement's check creates <dir>/<name>/
    ext = _build.Extension("test library", "nothing else happens.", lambda: None, about_s=1)
    calls = []

    def make():
        calls.append(1)
        raise RuntimeError("x.cpp:1:1: error: nope")

    for remember, tries in ((False, 2), (True, 1)):
        calls.clear()
        for _ in range(2):
            with pytest.raises(RuntimeError, match="x.cpp:1:1: error: nope"):
                ext.build(f"btlib_test_{remember}", make, detail="test", depends=[], remember_failure=remember)
        assert len(calls) == tries
        assert capsys.readouterr().err.count("btlib: compiling the test library (test) into") == tries
    assert ext.available("btlib_test_False") is None and "error: nope" in ext.available("btlib_test_True")


def test_the_build_info_line_reads_as_fields():
    """info_fields is the one parser of build_info(): the live build's line, and a line whose threads field holds
    spaces (a build without OpenMP)."""
    fields = build.info_fields(build.load())
    assert fields["vector"] == {"avx512bf16": "avx512"}.get(build.isa(), build.isa())
    assert fields["ops"] == f"btlib_cpu_{build.isa()}" and fields["W"] > 0 and fields["Br"] % fields["W"] == 0
    serial = ("portable W=4 kR=2 kNV=1 Br=16 Bc=32 max_head_dim=256 "
              "threads=serial (torch uses OpenMP but this build has no -fopenmp) ops=btlib_cpu_portable")
    assert build.info_fields(serial) == {
        "vector": "portable", "bf16dot": False, "amx": False, "W": 4, "kR": 2, "kNV": 1, "Br": 16, "Bc": 32,
        "max_head_dim": 256, "threads": "serial (torch uses OpenMP but this build has no -fopenmp)",
        "ops": "btlib_cpu_portable"}
