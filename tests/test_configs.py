"""Every config combination composes and validates without loading a model; bad input fails before any load.

Composition goes through Hydra's compose API on conf/ (as run.py does); every run of every experiment preset
is expanded from its `hydra.sweeper.params` the way the basic sweeper expands it. `adapter.load` is replaced
by a function that fails the test, so "validates" really means "without touching weights".
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import DATA_DIR, ROOT, ModelLoaded, method_from_conf, refuse_model_load
from experiments import cli_errors, identity, runner, validation

CONF = ROOT / "conf"
pytestmark = pytest.mark.skipif(not (Path(DATA_DIR) / "wikitext-2").is_dir(),
                                reason=f"evaluation data not found at {DATA_DIR} (set DATA_DIR): validation reads it")
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
POINTS = sorted(p.stem for p in (CONF / "point").glob("*.yaml"))
# configs that the presets name and that are written in parallel with them: a preset needing one that is not
# there yet is skipped (any other missing config fails)
PLANNED = {("method", m) for m in ("full", "infinigen", "oracle", "h2o", "quant", "streaming", "offload")}
PLANNED |= {("task", t) for t in ("ppl", "lm_eval", "latency")}


def slow_if_lm_eval(name: str, task: str | None):
    # lm-eval indexes its whole task tree for each distinct task list (tens of seconds on 2 cores)
    return pytest.param(name, marks=pytest.mark.slow) if task == "lm_eval" else name


def preset_task(preset: str) -> str | None:
    spec = yaml.safe_load((CONF / "experiment" / f"{preset}.yaml").read_text())
    return next((v for e in spec.get("defaults", []) for k, v in e.items() if k.endswith("/task")), None)


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    refuse_model_load(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def compose_cfg(overrides: list[str], hydra: bool = False):
    return compose("config", overrides=[f"data_dir={DATA_DIR}", *overrides], return_hydra_config=hydra)


def preset_runs(preset: str) -> list[list[str]]:
    """The override list of every run `python run.py -m +experiment=<preset>` launches."""
    cfg = compose_cfg([f"+experiment={preset}"], hydra=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params or {})
    # the basic sweeper puts its params before the command line's overrides: the preset is applied last
    overrides = [f"{k}={v}" for k, v in params.items()] + [f"+experiment={preset}"]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [run for batch in BasicSweeper.split_arguments(parsed, None) for run in batch]


def needed(preset: str) -> set[tuple[str, str]]:
    """(group, option) pairs a preset's runs select, read from its YAML and the point files it sweeps."""
    spec = yaml.safe_load((CONF / "experiment" / f"{preset}.yaml").read_text())
    out = set()
    for entry in spec.get("defaults", []):
        for key, option in entry.items():
            out.add((key.removeprefix("override ").strip("/"), option))
    for key, values in (spec.get("hydra", {}).get("sweeper", {}).get("params") or {}).items():
        for value in str(values).split(","):
            out.add((key.lstrip("+"), value.strip()))
    for group, option in list(out):
        if group == "point" and (CONF / "point" / f"{option}.yaml").is_file():
            point = yaml.safe_load((CONF / "point" / f"{option}.yaml").read_text())
            for entry in point.get("defaults", []):
                out |= {(k.removeprefix("override ").strip("/"), v) for k, v in entry.items()}
    return {(g, o) for g, o in out if g in ("model", "method", "task", "point")}


def missing_planned(preset: str) -> list[str]:
    absent = [(g, o) for g, o in sorted(needed(preset)) if not (CONF / g / f"{o}.yaml").is_file()]
    unplanned = [f"conf/{g}/{o}.yaml" for g, o in absent if (g, o) not in PLANNED]
    assert not unplanned, f"preset {preset} names configs that do not exist: {unplanned}"
    return [f"conf/{g}/{o}.yaml" for g, o in absent]


# ----------------------------------------------------------------------------------------------- every combination


@lru_cache(maxsize=None)
def every_model(task: str) -> dict:
    """Each model composed with `task` (ppl's default seq_len, 2048, is past the tiny models' 1024 positions:
    refused, as it should be, so they get a shorter one)."""
    fits = {model: (["task.seq_len=1024"] if task == "ppl" else ["task.lengths=[512]"] if task == "needle" else [])
            if model.startswith("tiny-") else [] for model in MODELS}
    return {model: compose_cfg([f"model={model}", f"task={task}", *fits[model]]) for model in MODELS}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("task", [slow_if_lm_eval(t, t) for t in TASKS])
def test_every_model_method_task_composes_and_validates(task, method):
    # Hydra composes each model and each method with the task (a compose costs ~0.1 s; the full product, 660 of
    # them, was a sixth of the suite); the product is then validated with the composed method node set into the
    # composed model's config: the group files have no defaults lists, so that is what composing both gives.
    assert not any("defaults" in OmegaConf.load(CONF / g / f"{o}.yaml") for g, names in
                   (("model", MODELS), ("method", [method])) for o in names)
    method_node = compose_cfg([f"method={method}", f"task={task}"]).method
    for model, composed in every_model(task).items():
        cfg = copy.deepcopy(composed)
        cfg.method = method_node
        # a prompt-compressing method (SnapKV) is refused without a prompt: give the tasks that default to none one
        if task in ("ppl", "lm_eval") and method_from_conf(method).needs_prompt:
            cfg.task.dense_rows = 256
        assert (cfg.model.name, cfg.task.name) == (model, task)
        validation.validate(cfg)


@pytest.mark.parametrize("point", POINTS)
def test_every_point_composes(point):
    spec = yaml.safe_load((CONF / "point" / f"{point}.yaml").read_text())
    method = next(v for e in spec["defaults"] for k, v in e.items() if k.endswith("/method"))
    if not (CONF / "method" / f"{method}.yaml").is_file():
        pytest.skip(f"conf/method/{method}.yaml not written yet")
    from hydra.utils import get_class

    target = yaml.safe_load((CONF / "method" / f"{method}.yaml").read_text())["_target_"]
    prompt = ["task.dense_rows=512"] if get_class(target).needs_prompt else []  # e.g. ShadowKV compresses one
    cfg = compose_cfg(["+point=" + point, *prompt])
    # the conf/method a run's rows are called by (run.py: Hydra's choice; infinigen_reference shares its _target_)
    assert compose_cfg(["+point=" + point, *prompt], hydra=True).hydra.runtime.choices.method == method
    if method not in ("infinigen_reference", "h2o_reference"):
        assert identity.method_name(cfg) == method
    for key, value in (spec.get("method") or {}).items():
        assert cfg.method[key] == value, (point, key)
    validation.validate(cfg)


@pytest.mark.parametrize("preset", [slow_if_lm_eval(p, preset_task(p)) for p in PRESETS])
def test_every_run_of_every_preset_composes_and_validates(preset):
    missing = missing_planned(preset)
    if missing:
        pytest.skip(f"{preset} needs {missing} (not written yet)")
    runs = preset_runs(preset)
    assert runs, f"{preset} launches no run"
    hashes, point_methods, models = set(), {}, set()
    for overrides in runs:
        cfg = compose_cfg(overrides)
        validation.validate(cfg)
        hashes.add(identity.config_hash(cfg))
        models.add(cfg.model.name)
        # the sweeper puts `+point=...` before `+experiment=...`: a preset that overrode /method would replace the
        # method each point chose (the speculation preset's oracle points once ran InfiniGen)
        point = next((o.split("=", 1)[1] for o in overrides if o.startswith("+point=")), None)
        if point is not None:
            if point not in point_methods:
                point_methods[point] = compose_cfg([f"+point={point}"]).method._target_
            assert cfg.method._target_ == point_methods[point], (preset, point)
    assert len(hashes) == len(runs), f"{preset}: two of its runs compute the same thing"
    if preset.endswith("_smoke"):
        assert models <= {"smollm2-135m", "tiny-llama", "tiny-llama-gqa", "tiny-opt"}, models


def group_option(spec: dict, group: str, default: str) -> str:
    return next((v for e in spec.get("defaults", []) for k, v in e.items() if k.endswith(f"/{group}")), default)


@pytest.mark.parametrize("name", [f"experiment/{p}" for p in PRESETS] + [f"point/{p}" for p in POINTS])
def test_presets_only_set_keys_their_configs_have(name):
    """A misspelt key in a preset would merge in as a new key and be ignored by the task or method: every
    task.* / method.* key a preset or point sets (or sweeps) must exist in the config it selects."""
    spec = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    sweeps = (spec.get("hydra") or {}).get("sweeper", {}).get("params") or {}
    for group, default in (("task", "ppl"), ("method", "full")):
        keys = set(spec.get(group) or {}) | {k.split(".", 1)[1] for k in sweeps if k.startswith(f"{group}.")}
        if not keys:
            continue
        options = [group_option(spec, group, default)]
        if group == "method" and "+point" in sweeps and options[0] == default:  # each swept point picks the method
            points = [yaml.safe_load((CONF / "point" / f"{p}.yaml").read_text()) for p in str(sweeps["+point"]).split(",")]
            options = sorted({group_option(point, group, default) for point in points})
        for option in options:
            path = CONF / group / f"{option}.yaml"
            if not path.is_file():
                assert (group, option) in PLANNED, f"{name}: conf/{group}/{option}.yaml does not exist"
                pytest.skip(f"conf/{group}/{option}.yaml not written yet")
            unknown = keys - set(OmegaConf.load(path))
            assert not unknown, f"{name} sets {group} keys {sorted(unknown)} that conf/{group}/{option}.yaml lacks"


def test_every_preset_has_a_smoke_variant_and_a_run_line():
    full = [p for p in PRESETS if not p.endswith(("_smoke", "_modelled"))]  # modelled: seconds on any CPU
    for preset in PRESETS:
        text = (CONF / "experiment" / f"{preset}.yaml").read_text()
        assert text.startswith("# @package _global_"), preset
        assert f"+experiment={preset}" in text, f"{preset}: its header should show the command that runs it"
    families = {p.removesuffix("_opt").removesuffix("_llama") for p in full}
    assert {f"{f}_smoke" for f in families} <= set(PRESETS)


def test_fig11_sweeps_the_paper_grid():
    for preset, pairs in [("fig11_accuracy_opt", {(2.0, 0.2), (4.0, 0.2), (5.0, 0.4), (7.0, 0.6)}),
                          ("fig11_accuracy_llama", {(5.0, 0.2), (7.0, 0.2), (7.0, 0.6), (7.0, 0.8)}),
                          ("fig11_accuracy_smoke", {(5.0, 0.2), (7.0, 0.2), (7.0, 0.6), (7.0, 0.8)})]:
        points = [o.split("=", 1)[1] for run in preset_runs(preset) for o in run if o.startswith("+point=")]
        specs = [yaml.safe_load((CONF / "point" / f"{p}.yaml").read_text()) for p in set(points)]
        methods = {next(iter(s["defaults"][0].values())) for s in specs}
        assert methods == {"full", "h2o", "quant", "infinigen"}, preset
        got = {(s["method"]["alpha"], s["method"]["budget"]) for s in specs if "alpha" in s.get("method", {})}
        assert got == pairs, preset
        heavy = {s["method"]["heavy"] for s in specs if "heavy" in s.get("method", {})}
        assert heavy == {0.25, 0.125, 0.0625, 0.03125}
        assert {s["method"]["bits"] for s in specs if "bits" in s.get("method", {})} == {8, 4, 2, 1}


def test_launchers_compose():
    launchers = [("slurm", "SlurmLauncher"), ("submitit_local", "LocalLauncher"), ("basic", "BasicLauncher")]
    for launcher, target in launchers:
        cfg = compose_cfg([f"hydra/launcher={launcher}"], hydra=True)
        assert cfg.hydra.launcher._target_.endswith(target)


# ----------------------------------------------------------------------------------------------- bad input


def run_cfg(overrides, tmp_path):
    fits = [] if any(o.startswith("task=") for o in overrides) else ["task.seq_len=512"]  # tiny-llama: 1024 positions
    return compose_cfg(["model=tiny-llama", "method=full", "task=ppl", f"results_dir={tmp_path}", *fits, *overrides])


def test_a_valid_config_does_reach_the_model_load(tmp_path):
    """The refusal below is what the bad-input tests rely on: a good config gets as far as loading."""
    with pytest.raises(ModelLoaded):
        runner.run(run_cfg(["task.seq_len=64", "task.max_windows=1"], tmp_path))


@pytest.mark.parametrize("overrides,error,match", [
    (["task.seq_len=0"], ValueError, "seq_len"),
    (["task.seq_len=abc"], ValueError, "seq_len"),
    (["task.stride=4096"], ValueError, "stride"),
    (["task.max_windows=0"], ValueError, "max_windows"),
    (["task.dense_rows=-1"], ValueError, "dense_rows"),
    (["task.dataset=wikitext103"], ValueError, "unknown dataset"),
    pytest.param(["task=lm_eval", "task.tasks=[not_a_task]"], ValueError, "unknown lm-eval task",
                 marks=pytest.mark.slow),
    (["task=lm_eval", "task.protocol=magic"], ValueError, "protocol"),
    (["+method.bogus=1"], cli_errors.UserError, "bogus"),
    (["model.random_init=false"], ValueError, "random_init"),
])
def test_bad_input_fails_before_any_model_load(overrides, error, match, tmp_path):
    if "task=lm_eval" in overrides and not (CONF / "task" / "lm_eval.yaml").is_file():
        pytest.skip("conf/task/lm_eval.yaml not written yet")
    with pytest.raises(error, match=match):
        runner.run(run_cfg(overrides, tmp_path))
    assert not (tmp_path / "rows").exists()


@pytest.mark.parametrize("method,overrides,match", [
    ("h2o", ["method.heavy=-1"], "heavy"),
    ("quant", ["method.bits=3"], "bits"),
    ("infinigen", ["method.eviction=random"], "eviction"),
    ("infinigen", ["method.partial_ratio=0"], "partial_ratio"),
    ("infinigen", ["method.budget=1.5"], "budget"),
    ("streaming", ["method.sinks=-1"], "sinks"),
    ("shadowkv", ["method.chunk=0"], "chunk"),
    ("shadowkv", ["method.budget=0"], "budget"),
    ("shadowkv", ["method.budget=1.5"], "budget"),
    ("rocketkv", ["method.budget=0"], "budget"),
    ("rocketkv", ["method.budget=1.5"], "budget"),
    ("rocketkv", ["method.split=1.5"], "split"),
    ("rocketkv", ["method.split=-0.1"], "split"),
    ("rocketkv", ["method.chunk=0"], "chunk"),
])
def test_bad_hyperparameters_fail_before_any_model_load(method, overrides, match, tmp_path):
    if not (CONF / "method" / f"{method}.yaml").is_file():
        pytest.skip(f"conf/method/{method}.yaml not written yet")
    # the dataclass's ValueError (which Hydra's instantiate wraps) becomes a user error naming the option
    with pytest.raises(cli_errors.UserError, match=match) as err:
        runner.run(run_cfg([f"method={method}", *overrides], tmp_path))
    assert err.value.option == overrides[0].split("=")[0]


@pytest.mark.parametrize("method,overrides,match", [
    ("shadowkv", ["method.rank=129"], "rank=129 exceeds head_dim x KV heads = 32 x 4 = 128"),
    ("rocketkv", ["method.channels=33"], "channels=33 exceeds head_dim = 32"),
])
def test_hyperparameters_past_the_models_shape_fail_before_any_model_load(method, overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        runner.run(run_cfg([f"method={method}", "task.dense_rows=8", *overrides], tmp_path))
    runner_ok = run_cfg([f"method={method}", "task.dense_rows=8", "task.seq_len=64", "task.max_windows=1"], tmp_path)
    with pytest.raises(ModelLoaded):  # the same method within the shape gets as far as the load
        runner.run(runner_ok)


def test_missing_data_file_fails_before_any_model_load(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    with pytest.raises(cli_errors.UserError, match="wiki.test.raw"):
        runner.run(run_cfg([f"data_dir={empty}"], tmp_path))
    with pytest.raises(cli_errors.UserError, match="not a directory"):
        runner.run(run_cfg([f"data_dir={tmp_path / 'nowhere'}"], tmp_path))


def test_missing_column_calibration_text_fails_before_any_model_load(tmp_path):
    """InfiniGen's column_calibration (the artifact's partial-weight prompt, issue 72) is a data file like the
    calibration text: a data folder without it is refused naming the option and the file, before the model loads;
    the folder that has it gets as far as the load."""
    partial = tmp_path / "data"
    partial.mkdir()
    for name in ("wikitext-2", "pg19"):
        (partial / name).symlink_to(Path(DATA_DIR).resolve() / name)
    prompt = ["method=infinigen_reference", "method.column_calibration=infinigen_prompt", "method.column_tokens=null"]
    with pytest.raises(cli_errors.UserError, match=r"column_calibration.*partial_weight_prompt\.txt"):
        runner.run(run_cfg([f"data_dir={partial}", *prompt], tmp_path))
    if (Path(DATA_DIR) / "infinigen_artifact" / "partial_weight_prompt.txt").is_file():
        with pytest.raises(ModelLoaded):
            runner.run(run_cfg(prompt, tmp_path))


def test_column_calibration_at_null_keeps_every_hash_and_keys_the_run_when_set():
    """A null column_calibration is the behaviour from before the option: the config hash leaves it out (the stored
    rows keep matching); set, it changes the hash and its text's identity is part of the row's data."""
    base = compose_cfg(["model=smollm2-135m", "method=infinigen_reference", "task=ppl"])
    assert base.method.column_calibration is None and "column_calibration" not in identity.data_identity(base)
    if not (Path(DATA_DIR) / "infinigen_artifact" / "partial_weight_prompt.txt").is_file():
        pytest.skip("the data folder has no infinigen_artifact/partial_weight_prompt.txt")
    point = compose_cfg(["model=smollm2-135m", "+point=infinigen_reference_artifact_prompt", "task=ppl"])
    assert point.method.column_calibration == "infinigen_prompt" and point.method.column_tokens is None
    assert identity.config_hash(point) != identity.config_hash(base)
    assert identity.data_identity(point)["column_calibration"]["sha256"] == (
        "484327ad1f9b5d2aacb95e6d61cc4647e29f21f2b24efb799c9c1a53d6a7fd04")


@pytest.mark.parametrize("overrides", [["task.sequence_length=64"], ["method=nonexistent"], ["model=gpt-5"],
                                       ["+experiment=fig99"], ["+point=h2o_0.3"]])
def test_unknown_options_fail_at_composition(overrides, tmp_path):
    with pytest.raises(ConfigCompositionException):
        run_cfg(overrides, tmp_path)


FROZEN_HASHES = json.loads((ROOT / "tests" / "data" / "config_hashes.json").read_text())


@pytest.mark.parametrize("point", sorted(FROZEN_HASHES))
def test_config_hash_is_frozen(point):
    """Every conf/method's config hash at a fixed model and task, as it was before the code moved (issue 57):
    moving a method's class (its `_target_`) or a refactor must not stale the stored rows hashed with it.
    A changed hash means the rows stored under the old one no longer match (infinigen/semantic.py aliases moves)."""
    model, method = point.split("/")
    cfg = compose_cfg([f"model={model}", f"method={method}", "task=ppl"])
    assert identity.config_hash(cfg) == FROZEN_HASHES[point]


def stored_lm_eval_rows() -> list[dict]:
    """The first row of each lm_eval run in the committed store (docs/store), as written."""
    files = sorted((ROOT / "docs" / "store" / "rows").glob("*.jsonl"))
    rows = [json.loads(path.read_text().splitlines()[0]) for path in files]
    return [row for row in rows if row["task"] == "lm_eval"]


def test_lm_eval_batch_size_keeps_the_config_hash():
    """lm_eval's batch_size changes how fast it runs, not what it computes (equal-length requests per forward, never
    padded): the default went from 1 to auto (issue 63), and every lm_eval run the store holds, written at 1 or at
    auto, has the config hash its config gives at any batch size, so it still matches and a re-run still skips it."""
    rows = stored_lm_eval_rows()
    assert rows and {row["config"]["task"]["batch_size"] for row in rows} == {1, "auto"}
    assert compose_cfg(["task=lm_eval"]).task.batch_size == "auto"
    for row in rows:
        cfg = OmegaConf.create(row["config"] | {"data_dir": DATA_DIR})
        hashes = set()
        for batch_size in ("auto", 1, 16):
            cfg.task.batch_size = batch_size
            hashes.add(identity.config_hash(cfg))
        assert hashes == {row["config_hash"]}, row["config"]["task"]
