"""The set-up resolves off Linux x86_64: `make lab`'s requirement set, resolved by uv for other platforms.

uv (not pip) because pip's --platform only filters wheel tags: it evaluates environment markers
for the machine it runs on, so a macOS resolution run here would still pull Linux-only
dependencies. ``uv pip compile --python-platform`` evaluates markers for the target and, with
--only-binary :all:, accepts a package only if a wheel for that platform exists. It reads
metadata only (no multi-GB downloads). Against the public index; skipped where it is unreachable.
"""

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_TOOLS = {"pytest", "nbval", "hypothesis", "playwright", "uv", "openai"}


def _uv() -> str | None:
    found = Path(sys.executable).parent / "uv"
    return str(found) if found.exists() else shutil.which("uv")


def _index_reachable() -> str | None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return None
    except OSError as e:
        return f"the package index is unreachable ({e})"


def resolve(platform: str, extra: str = "lab", macos: str | None = None) -> subprocess.CompletedProcess:
    """uv pip compile pyproject.toml --extra EXTRA -c requirements/pins.txt for ``platform``, Python 3.11, wheels only."""
    uv = _uv()
    if uv is None:
        pytest.skip("uv is not installed (make test installs it: pip install -e '.[dev]')")
    if why := _index_reachable():
        pytest.skip(why)
    env = {**os.environ, **({"MACOSX_DEPLOYMENT_TARGET": macos} if macos else {})}  # torch 2.13's mac wheels need 14.0
    return subprocess.run(
        [uv, "pip", "compile", "pyproject.toml", "--extra", extra, "-c", "requirements/pins.txt", "--python-version", "3.11",
         "--python-platform", platform, "--only-binary", ":all:", "--no-header", "--no-annotate", "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _names(res: subprocess.CompletedProcess) -> dict[str, str]:
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", res.stdout, re.M))


@pytest.mark.parametrize("platform, macos", [("aarch64-apple-darwin", "14.0"), ("x86_64-pc-windows-msvc", None)],
                         ids=["macos_arm64", "windows_amd64"])
def test_make_lab_set_resolves_to_wheels(platform, macos):
    """macOS arm64 and Windows: every package of btlib[lab] at its pin has a wheel there (transformers and the compare
    engines included); no triton, no test tools."""
    got = _names(resolve(platform, macos=macos))
    pins = dict(line.split("==") for line in (ROOT / "requirements" / "pins.txt").read_text().splitlines()
                if line and not line.startswith("#") and "==" in line)
    assert got["torch"] == pins["torch"] and got["jupyterlab"] == pins["jupyterlab"] and got["tokenizers"] == pins["tokenizers"]
    assert got["transformers"] == pins["transformers"] and got["onnxruntime"] == pins["onnxruntime"], \
        "make lab lacks what notebooks 07 and 08 run"
    assert "triton" not in got, "triton has no wheels here: pyproject's gpu extra must carry its platform marker"
    assert not TEST_TOOLS & set(got), f"make lab installs test tools: {TEST_TOOLS & set(got)}"


@pytest.mark.parametrize("platform", ["x86_64-manylinux_2_28", "aarch64-manylinux_2_28"])
def test_linux_from_the_public_index_resolves(platform):
    """Linux from PyPI alone: torch 2.13.0 is then its CUDA build, which requires triton==3.7.1; the pin
    file's triton range admits it (this machine's CPU wheel requires no triton and takes 3.9.0)."""
    got = _names(resolve(platform))
    assert got["torch"] == "2.13.0" and got["triton"] == "3.7.1", got
    assert not TEST_TOOLS & set(got), f"make lab installs test tools: {TEST_TOOLS & set(got)}"
