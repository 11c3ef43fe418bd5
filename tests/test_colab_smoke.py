"""The notebooks' setup cell: a no-op here, and in a Colab-like runtime it installs btlib so that
notebooks 01 and 06 run top to bottom.

The Colab-like runtime is a fresh virtual environment holding only what Colab preinstalls that the
notebooks need (torch, numpy, matplotlib, ipywidgets, a Jupyter kernel and nbclient), started with an
environment built from scratch: a fresh HOME (so a cold torch-extensions cache, as in Colab), PATH
without this environment's bin, no PYTHONPATH or JUPYTER_* or BTLIB_* variables but the two set
here. The setup cell's install step is pointed (``BTLIB_SETUP_FROM``) at a git snapshot of this
working tree, so it runs exactly what Colab runs, ``git clone`` + ``pip install --no-deps -e``.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from btlib.device import describe_device, gpu_notes
from workbook import add_colab_cells, colab_cells, repository_url

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("01_naive_attention", "06_padding_sparsity")
COLAB_PREINSTALLED = ("torch", "numpy", "matplotlib", "ipywidgets", "ipykernel", "nbclient")

RUNNER = textwrap.dedent("""\
    import importlib.util, json, os, shutil, subprocess, sys
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    content, out, *notebooks = sys.argv[1:]
    assert importlib.util.find_spec("btlib") is None, "btlib importable before the setup cell ran"
    spec = KernelSpecManager().get_kernel_spec("python3")
    kernel_python = os.path.realpath(shutil.which(spec.argv[0]))
    assert kernel_python == os.path.realpath(sys.executable), spec.argv  # the kernel is this venv's python

    def packages():
        listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
        return {f"{p['name']}=={p['version']}" for p in json.loads(listed.stdout)}

    before = packages()
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": content}}).execute()
        nbformat.write(nb, f"{out}/{path.rsplit('/', 1)[1]}")
    after = packages()
    print(json.dumps({"added": sorted(after - before), "removed": sorted(before - after)}))
""")


def _setup_cell(nb) -> nbformat.NotebookNode:
    return next(c for c in nb.cells if c.get("id") == "colab-setup")


def test_colab_cells_follow_the_url_and_leave_the_rest(tmp_path):
    """A fork's URL replaces badge and setup cell; a second pass changes nothing; other cells keep their outputs."""
    path = ROOT / "notebooks" / "06_padding_sparsity.ipynb"
    nb = nbformat.read(path, as_version=4)
    rest = [c for c in nb.cells if c.get("id") not in ("colab-badge", "colab-setup")]
    fork = "https://github.com/someone/my-fork"
    assert add_colab_cells(nb, path.stem, fork)
    assert "/someone/my-fork/blob/main/notebooks/06_padding_sparsity.ipynb" in nb.cells[0].source
    assert f'REPO = "{fork}"' in _setup_cell(nb).source and 'abspath("my-fork")' in _setup_cell(nb).source
    assert not add_colab_cells(nb, path.stem, fork)
    assert [c for c in nb.cells if c.get("id") not in ("colab-badge", "colab-setup")] == rest
    assert [c.get("id") for c in nb.cells[:3]] == ["colab-badge", rest[0].get("id"), "colab-setup"]
    bare = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])  # no title cell: setup goes first
    assert add_colab_cells(bare, "99_new", fork) and [c.get("id") for c in bare.cells][:2] == ["colab-badge", "colab-setup"]


def test_setup_cell_does_nothing_outside_colab(tmp_path):
    """Without Colab and without BTLIB_SETUP_FROM the cell clones nothing, installs nothing, only describes the device."""
    _, setup = colab_cells("01_naive_attention")
    guard = "import subprocess\ndef refuse(*a, **k): raise AssertionError(f'ran {a}')\nsubprocess.run = refuse\n"
    env = {k: v for k, v in os.environ.items() if k != "BTLIB_SETUP_FROM"}
    res = subprocess.run([sys.executable, "-c", guard + setup], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("btlib ") and "device: " in res.stdout
    assert list(tmp_path.iterdir()) == []


def test_describe_device_says_what_the_hardware_means(monkeypatch, capsys):
    monkeypatch.setenv("BTLIB_QUICK", "1")
    text = describe_device()
    assert capsys.readouterr().out.strip() == text
    assert f"from {ROOT}" in text and "sizes: quick" in text
    if "GPU" not in text.splitlines()[1]:
        assert "no GPU: the GPU cells skip" in text
    assert "without tensor cores" in " ".join(gpu_notes(7, 5))  # T4
    assert "tensor cores for fp16 and bf16" in " ".join(gpu_notes(8, 0))


def _clean_env(home: Path) -> dict[str, str]:
    """What a fresh Colab-like process sees: the machine's PATH without this environment, pip's machine config."""
    outer = {Path(sys.prefix).resolve(), (ROOT / ".venv").resolve()}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and not any(Path(p).resolve().is_relative_to(o) for o in outer)]
    env = {"PATH": os.pathsep.join(path), "HOME": str(home), "LANG": os.environ.get("LANG", "C.UTF-8")}
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})  # the machine's package index and wheels
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))  # downloads only
    return env


def _snapshot(dest: Path) -> None:
    """A one-commit git repository of this working tree (tracked and untracked, not ignored files): what a push holds."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    git = ["git", "-c", "user.name=smoke", "-c", "user.email=smoke@localhost", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run([*git, *args], cwd=dest, check=True)


@pytest.mark.slow
def test_colab_like_runtime_runs_notebooks_01_and_06(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout: the setup cell clones the workbook")
    t0 = time.time()
    home, content, src, out = (tmp_path / d for d in ("home", "content", "src", "out"))
    for d in (home, content, src, out):
        d.mkdir()
    env = _clean_env(home)
    venv = tmp_path / "colab-venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], env=env, capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtual environment here: {made.stderr.strip()[-300:]}")
    py = str(venv / "bin" / "python")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    # --no-compile: the same packages, without byte-compiling every module of torch first (45 s -> 14 s here);
    # the notebooks' kernel compiles what it imports, as any first import does
    installed = subprocess.run([py, "-m", "pip", "install", "-q", "--no-compile", "-c", str(ROOT / "requirements" / "pins.txt"),
                                *COLAB_PREINSTALLED], env=env, capture_output=True, text=True)
    if installed.returncode != 0:
        pytest.skip(f"pip cannot install Colab's preinstalled packages here: {installed.stderr.strip()[-500:]}")
    t_venv = time.time() - t0
    _snapshot(src)
    (tmp_path / "runner.py").write_text(RUNNER)
    env.update(BTLIB_SETUP_FROM=src.as_uri(), BTLIB_QUICK="1")
    res = subprocess.run([py, str(tmp_path / "runner.py"), str(content), str(out),
                          *(str(ROOT / "notebooks" / f"{n}.ipynb") for n in NOTEBOOKS)],
                         env=env, cwd=content, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    packages = json.loads(res.stdout.strip().splitlines()[-1])
    assert packages["removed"] == [] and packages["added"] == ["btlib==0.1.0"], packages
    checkout = content / repository_url().rsplit("/", 1)[1]
    for name in NOTEBOOKS:
        nb = nbformat.read(out / f"{name}.ipynb", as_version=4)
        said = "".join(o.get("text", "") for o in _setup_cell(nb).outputs)
        assert f"btlib 0.1.0 from {checkout}" in said and "sizes: quick" in said, said
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert not errors, errors
    print(f"Colab-like smoke test: venv {t_venv:.0f} s, total {time.time() - t0:.0f} s")
