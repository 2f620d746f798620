"""`pip install .` installs the whole project: a wheel built from the working tree as a clean clone holds it, installed
outside the repo, has every module (each imports from the install, not the checkout) and every config, and the
Python API runs from it on tiny-llama (README "Use it from Python")."""

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import DATA_DIR, ROOT

pytestmark = pytest.mark.slow  # builds a wheel and imports every module in a fresh interpreter (~30-60 s)

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

# the library without the `experiments` extra: the API from the wheel, every extra's package hidden
API = r"""
import pathlib, sys
target, site_packages, data_dir, cache = sys.argv[1:5]
sys.path[:] = [target] + [p for p in sys.path if p and "site-packages" not in p] + [site_packages]
import infinigen
import infinigen.method.infinigen
from infinigen.models import conf_dir
assert str(conf_dir()).startswith(target), conf_dir()
model, tokenizer = infinigen.load_model("tiny-llama")
method = infinigen.load_method("infinigen", model=model, data_dir=data_dir, budget=0.1, cache_dir=cache)
out = infinigen.generate(model, method, tokenizer("Hello", return_tensors="pt").input_ids, 6, do_sample=False)
with infinigen.apply(model, method):
    again = model.generate(tokenizer("Hello", return_tensors="pt").input_ids, max_new_tokens=6, do_sample=False)
assert (again == out.sequences).all()
hidden = [m for m in sys.modules if m.split(".")[0] in ("lm_eval", "datasets", "wandb", "pandas", "matplotlib",
                                                         "accelerate", "triton", "submitit")]
assert hidden == [], hidden
print("generated", out.new_tokens[0], repr(tokenizer.decode(out.generated(0))), out.stats["kv_fraction"])
"""
EXTRAS = ("lm-eval", "datasets", "wandb", "pandas", "matplotlib", "accelerate", "triton", "hydra-submitit-launcher",
          "submitit")  # the distributions pyproject.toml's `experiments` extra names (submitit: the launcher's)


def core_site_packages(dest: Path) -> Path:
    """This environment's site-packages without the `experiments` extra's distributions: a folder of links to every
    other entry (what `pip install .` without extras leaves a library user with, as far as imports go)."""
    import importlib.metadata as md

    site = Path(sysconfig.get_paths()["purelib"])
    hidden = set()
    for name in EXTRAS:
        try:
            files = md.distribution(name).files or []
        except md.PackageNotFoundError:
            continue
        hidden |= {f.parts[0] for f in files if f.parts[0] not in ("..", "__pycache__")}
    dest.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and not entry.name.endswith(".pth"):
            (dest / entry.name).symlink_to(entry)
    return dest


def test_every_module_imports_from_the_installed_wheel(wheel_install, tmp_path):
    _, base = wheel_install
    done = subprocess.run(
        [sys.executable, "-S", "-c", CHECK, str(base / "site"), sysconfig.get_paths()["purelib"]],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len([m for m in repo_modules() if not m.endswith('__main__')])}" in done.stdout


def test_the_api_runs_from_the_wheel_without_the_experiments_extra(wheel_install, tmp_path, data_dir):
    _, base = wheel_install
    site = core_site_packages(tmp_path / "core")
    done = subprocess.run([sys.executable, "-S", "-c", API, str(base / "site"), str(site),
                           str(Path(DATA_DIR).resolve()), str(tmp_path / "skew")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generated 6 " in done.stdout, done.stdout
