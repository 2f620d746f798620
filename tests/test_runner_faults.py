"""The runner as a stranger meets it (issues 10 and 16): every class of bad input is refused by name before a
model loads (and, from run.py, within seconds), a run whose logits or metrics go non-finite fails with no row,
concurrent launches of one config run it once, and rows that cannot be stored are kept for re-import."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from analysis import store
from conftest import DATA_DIR, ROOT, refuse_model_load
from experiments import cli_errors, runner, validation
from infinigen import adapter, models

pytestmark = pytest.mark.skipif(not (Path(DATA_DIR) / "wikitext-2").is_dir(),
                                reason=f"evaluation data not found at {DATA_DIR} (set DATA_DIR)")
TINY_PPL = ["model=tiny-llama", "method=full", "task=ppl", "task.seq_len=32", "task.max_windows=1"]


@pytest.fixture
def no_model_load(monkeypatch):
    refuse_model_load(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield


def cfg_of(overrides: list[str], results: Path):
    """TINY_PPL with `overrides` on top; choosing another model/method/task drops TINY_PPL's choice (and, for
    another task, its task.* settings)."""
    groups = {o.split("=", 1)[0] for o in overrides if o.split("=", 1)[0] in ("model", "method", "task")}
    base = [o for o in TINY_PPL if o.split("=", 1)[0] not in groups and not ("task" in groups and o.startswith("task."))]
    return compose("config", overrides=[*base, f"data_dir={DATA_DIR}", f"results_dir={results}", *overrides])


def checkpoint(tmp_path: Path, model_type: str = "llama", positions: int = 4096) -> Path:
    """A checkpoint folder as far as validation reads it: its config.json."""
    folder = tmp_path / f"ckpt-{model_type}-{positions}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": positions}))
    return folder


# ----------------------------------------------------------------------------------------------- bad input

BAD = [  # (overrides, message); {ckpt} / {gpt2} are checkpoint folders made by the test
    (["seed=1.5"], "seed must be an integer, got 1.5"),
    (["force=maybe"], "force must be true or false"),
    (["results_dir="], "results_dir must be a folder path"),
    (["logger.backends=[tensorboard]"], "logger.backends may hold only 'wandb'"),
    (["device=tpu"], "device must be null \\(auto\\), cpu, cuda, cuda:N or mps, got 'tpu'"),
    (["device=cuda:99"], "device='cuda:99' is not available"),
    (["model.dtype=float17"], "model.dtype must be one of \\['float32', 'float16', 'bfloat16', 'float64'\\]"),
    (["model=tiny-opt", "task.seq_len=4096"], "task.seq_len = 4096 is beyond the max_position_embeddings of model "
                                              "tiny-opt \\(1024\\)"),
    (["task=latency", "task.prompt_len=1020", "task.gen_len=16"], "task.prompt_len \\+ task.gen_len = 1036 is beyond"),
    (["+model.local_path=/nowhere"], "random_init builds `arch` with random weights; it cannot also use"),
    (["model=smollm2-135m", "+model.local_path=/nowhere"], "model.local_path='/nowhere' is neither a checkpoint"),
    (["model=smollm2-135m", "+model.local_path={gpt2}"], "unsupported architecture 'gpt2'"),
    (["model=smollm2-135m", "+model.local_path={ckpt}", "task.seq_len=512"],
     "task.seq_len = 512 is beyond the max_position_embeddings of model smollm2-135m \\(256\\)"),
    (["method=oracle", "method.budget=abc"], "method.budget must be a number, got 'abc'"),
    (["method=infinigen", "method.max_num_kv=2.5"], "method.max_num_kv must be an integer or null, got 2.5"),
    (["method=infinigen", "method.skew=maybe"], "method.skew must be true or false, got 'maybe'"),
    (["method=h2o", "method.heavy=true"], "method.heavy must be a number, got True"),
    (["task=latency", "task.runtime=warp"], "task.runtime must be one of"),
    (["task=lm_eval", "task.limit=0"], "task.limit must be null \\(every doc\\) or an integer >= 1"),
    (["task=latency", "task.timing=modelled", "task.schedule=flexgen"],
     "task.schedule must be one of \\('overlapped', 'paper'\\), got 'flexgen'"),
    (["task=latency", "task.timing=modelled", "task.schedule=paper", "task.fetch_fraction=1.5"],
     "task.fetch_fraction must be null \\(measured rows: task.fractions_from\\), paper"),
    (["task=latency", "task.timing=modelled", "task.schedule=paper", "+task.paper.weight_offload=1.0"],
     "task.paper.weight_offload must be null \\(as the artifact ran the model\\) or a share in \\[0, 1\\)"),
    (["task=latency", "task.schedule=paper"], "task.schedule=paper models the paper's runtime: it needs"),
    (["task=latency", "task.timing=modelled", "task.schedule=paper", "task.gen_len=1", "task.warmup=0"],
     "task.gen_len must be an integer >= 2 under task.schedule=paper"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_refused_by_name_before_the_model_loads(overrides, message, tmp_path, no_model_load):
    folders = {"ckpt": checkpoint(tmp_path, positions=256), "gpt2": checkpoint(tmp_path, "gpt2")}
    overrides = [o.format(**folders) for o in overrides]
    with pytest.raises(cli_errors.UserError, match=message) as err:
        runner.run(cfg_of(overrides, tmp_path / "results"))
    assert not (tmp_path / "results").exists()  # nothing written, not even the store's folders
    # the option it names is one the user set (or the group holding it)
    keys = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    assert any(k == err.value.option or k.startswith(err.value.option + ".") for k in keys), err.value.option


def test_cuda_build_is_read_without_importing_torch():
    import torch

    assert validation.torch_cuda_build() is (torch.version.cuda is not None)


@pytest.mark.skipif(validation.torch_cuda_build() is not False, reason="torch here has CUDA")
def test_cuda_on_a_cpu_only_torch_is_refused_before_the_model_loads(tmp_path, no_model_load):
    with pytest.raises(ValueError, match="device='cuda' is not available: torch here is a CPU-only build"):
        runner.run(cfg_of(["device=cuda"], tmp_path))


def test_local_path_wins_over_the_bundled_gguf(tmp_path):
    smollm2 = compose("config", overrides=["model=smollm2-135m"]).model
    assert models.source(smollm2)[1] == {"gguf_file": models.SMOLLM2_GGUF}
    folder = checkpoint(tmp_path)
    local = compose("config", overrides=["model=smollm2-135m", f"+model.local_path={folder}"]).model
    assert models.source(local) == (str(folder), {})
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(b"GGUF")
    assert models.source(compose("config", overrides=["model=smollm2-135m", f"+model.local_path={gguf}"]).model) \
        == (str(tmp_path), {"gguf_file": "other.gguf"})


def run_py(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args, f"data_dir={DATA_DIR}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


# one of each way bad input reaches run.py: a runner check, a Hydra override it cannot parse, a config group option
# or key that does not exist, an output folder Hydra cannot create
CLI_BAD = [(["seed=1.5"], "seed: must be an integer, got 1.5"),
           (["seed=["], "seed: cannot parse 'seed=['"),
           (["method=nosuch"], "method: no method named 'nosuch'; choose one of: full, h2o,"),
           (["task.nosuch=1"], "task.nosuch: Could not override 'task.nosuch'"),
           (["results_dir={file}/sub"], "results_dir: cannot create Hydra's output folder")]


@pytest.mark.parametrize("overrides,line", CLI_BAD, ids=[o[0] for o, _ in CLI_BAD])
def test_bad_input_is_one_line_and_exit_2_from_run_py(overrides, line, tmp_path):
    """The whole command line, Hydra included: refused before torch is even imported, as one line on stderr.
    15 s leaves CI machines slack; on an idle 2-core machine this takes about a second."""
    (tmp_path / "file").write_text("a file where a folder should be")
    overrides = [o.format(file=tmp_path / "file") for o in overrides]
    t0 = time.perf_counter()
    done = run_py(*TINY_PPL, f"results_dir={tmp_path / 'results'}", *overrides)
    seconds = time.perf_counter() - t0
    assert (done.returncode, done.stderr.splitlines()) == (2, [done.stderr.strip()]), done.stderr[-2000:]
    assert done.stderr.startswith(f"error: {line}")
    assert seconds < 15, f"refusal took {seconds:.1f} s"


def test_debug_shows_the_trace_of_a_refusal(tmp_path):
    for how in (["debug=true"], []):
        env = os.environ | ({"HYDRA_FULL_ERROR": "1"} if not how else {})
        done = run_py(*TINY_PPL, f"results_dir={tmp_path}", "seed=1.5", *how, env=env)
        assert done.returncode == 2 and "Traceback (most recent call last)" in done.stderr
        assert done.stderr.strip().endswith("error: seed: must be an integer, got 1.5")


def test_a_refused_sweep_point_does_not_stop_the_others_and_is_summed_up(tmp_path):
    done = run_py("-m", *TINY_PPL, f"results_dir={tmp_path}", "seed=1.5,2.5,[0]")
    refused = [line for line in done.stderr.splitlines() if line.startswith("error: seed:")]
    assert len(refused) == 3, done.stderr[-3000:]  # the first refusal did not stop the sweep
    summary = done.stderr[done.stderr.index("sweep: 3 of 3 points refused"):].splitlines()
    assert [line.split(": ", 1)[0].split()[0] for line in summary[1:]] == ["#0", "#1", "#2"]
    assert done.returncode == 2 and "Traceback" not in done.stderr


# ----------------------------------------------------------------------------------------------- weights


def hub_cache_with(root: Path, hf_id: str) -> None:
    """A Hugging Face hub cache under `root` holding `hf_id`'s config.json, laid out as huggingface_hub does."""
    repo, commit = root / f"models--{hf_id.replace('/', '--')}", "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")


def test_weights_that_cannot_be_had_are_one_line_and_exit_2_from_run_py(tmp_path):
    """A hub model that is not on disk, offline: refused like bad input, naming what gets a run going without
    it, in seconds (not transformers' hub retries and three tracebacks)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    t0 = time.perf_counter()
    done = run_py("model=opt-13b", "method=infinigen", f"results_dir={tmp_path / 'results'}", env=env)
    seconds = time.perf_counter() - t0
    assert (done.returncode, done.stderr.splitlines()) == (2, [done.stderr.strip()]), done.stderr[-2000:]
    assert done.stderr.startswith("error: model.local_path: weights for model 'opt-13b' (hub id facebook/opt-13b) "
                                  "are not in the local Hugging Face cache")
    assert "model.random_init=true" in done.stderr and "HF_HUB_OFFLINE is set" in done.stderr
    assert seconds < 15, f"refusal took {seconds:.1f} s"
    assert not list(store.rows_dir(tmp_path / "results").glob("*.jsonl"))


def test_hub_weights_are_looked_up_on_disk_before_the_hub_is_asked(tmp_path, monkeypatch, no_model_load):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = cfg_of(["model=opt-13b"], tmp_path / "results")
    with pytest.raises(cli_errors.UserError, match="HF_HUB_OFFLINE is set") as err:  # offline (conftest), not on disk
        runner.run(cfg)
    assert err.value.option == "model.local_path" and "model.random_init=true" in err.value.message
    # online, but nothing answers the one connection made: the same refusal, with why
    monkeypatch.setattr("huggingface_hub.is_offline_mode", lambda: False)
    monkeypatch.setattr(models, "hub_unreachable", lambda endpoint: f"{endpoint} does not answer (a test)")
    with pytest.raises(cli_errors.UserError, match=r"the hub cannot be asked \(https://\S+ does not answer \(a test\)\)"):
        runner.run(cfg)
    # on disk: accepted, and read from there alone (nothing for transformers to retry)
    hub_cache_with(tmp_path / "hub", "facebook/opt-13b")
    models.check_available(cfg.model)
    assert models.source(cfg.model) == ("facebook/opt-13b", {"local_files_only": True})
    monkeypatch.setattr(models, "hub_unreachable", lambda endpoint: None)  # a hub that answers is asked
    assert models.source(cfg.model) == ("facebook/opt-13b", {})


def test_a_run_that_loads_no_weights_needs_none(tmp_path, no_model_load):
    """random_init builds the architecture, and a modelled latency run reads only the config: neither is refused
    for weights that are not on disk (offline here)."""
    validation.check_weights(cfg_of(["model=opt-13b", "model.random_init=true"], tmp_path))
    validation.check_weights(cfg_of(["model=opt-13b", "task=latency", "task.timing=modelled", "hardware=a6000_pcie3"],
                                tmp_path))


# ----------------------------------------------------------------------------------------------- non-finite


def test_nan_logits_fail_lm_eval_scoring():
    """lm-eval turns NaN log-likelihoods into a plausible accuracy (argmax of NaNs): the LM refuses them."""
    import torch

    from baselines.full import Full
    from conftest import model_cfg
    from experiments.lm_eval_lm import KVMethodLM

    model, _ = adapter.load(model_cfg("tiny-llama", arch={"rope_theta": 0.0}))
    lm = KVMethodLM(model, None, Full(), max_length=64)
    ids = torch.randint(0, 256, (17,)).tolist()
    with pytest.raises(FloatingPointError, match=r"lm_eval: non-finite logits in forward 1 \(batch \(1, 16\)\)"):
        lm._loglikelihood_tokens([(None, ids[:9], ids[9:])], disable_tqdm=True)


def test_non_finite_metrics_write_no_row(tmp_path, monkeypatch):
    from experiments import ppl

    monkeypatch.setattr(adapter, "load", lambda cfg, device: (None, None))
    monkeypatch.setattr(ppl, "run", lambda *a, **k: {"ppl": math.inf, "nll": 1.0, "acc_stderr": math.nan,
                                                     "stats": {"per_layer": {"recall": {0: math.nan}}}})
    with pytest.raises(runner.NonFiniteError, match=r"\['ppl', 'stats.per_layer.recall.0'\]; no row written"):
        runner.run(cfg_of([], tmp_path))  # stderr columns may be NaN (n = 1); the others may not
    assert not list(store.rows_dir(tmp_path).glob("*.jsonl"))


def test_nan_logits_exit_non_zero_naming_window_and_layer(tmp_path):
    # rope_theta = 0: inv_freq = 0 ** (-x) = inf, so every rotated query/key is NaN from the first layer on
    done = subprocess.run([sys.executable, str(ROOT / "run.py"), *TINY_PPL, "model.arch.rope_theta=0",
                           f"results_dir={tmp_path}", f"data_dir={DATA_DIR}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr  # not bad input: a trace
    assert "non-finite logits in window 0 (tokens 0..31), first in decoder layer 0 of 3" in done.stderr
    assert not list(store.rows_dir(tmp_path).glob("*.jsonl"))
    assert not list(store.claims_dir(tmp_path).iterdir())  # the claim was released


# ----------------------------------------------------------------------------------------------- the store


def test_an_unwritable_results_dir_is_refused_before_the_model_loads(tmp_path, no_model_load):
    (tmp_path / "rows").write_text("a file where the rows folder should be")
    with pytest.raises(cli_errors.UserError, match="is not writable") as err:
        runner.run(cfg_of([], tmp_path))
    assert err.value.option == "results_dir"


def test_rows_that_cannot_be_written_are_kept_and_re_imported(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "append_rows", full_disk)
    with pytest.raises(store.StoreError, match="the computed rows are kept in (\\S+): add them") as err:
        runner.run(cfg_of([], tmp_path))
    monkeypatch.undo()
    kept = Path(str(err.value).split("kept in ", 1)[1].split(":", 1)[0])
    assert kept.is_file() and kept.parent.parent == tmp_path / "runs"  # in the run's own folder
    store.import_rows(kept, tmp_path)
    df = store.load(tmp_path)
    assert len(df) == 1 and df["metrics.ppl"].iloc[0] > 1


def test_forced_runs_of_one_config_get_distinct_run_folders(tmp_path):
    for _ in range(2):
        runner.run(cfg_of(["force=true"], tmp_path))
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert len(store.load(tmp_path, latest_only=False)) == 2


@pytest.mark.slow
def test_four_concurrent_launches_of_one_config_run_it_once(tmp_path):
    cmd = [sys.executable, str(ROOT / "run.py"), *TINY_PPL, f"results_dir={tmp_path}", f"data_dir={DATA_DIR}"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert len(list(store.rows_dir(tmp_path).glob("*.jsonl"))) == 1
    assert sum("[done]" in o for o, _ in outs) == 1 and sum("[skip]" in o for o, _ in outs) == 3
    hydra_dirs = list((tmp_path / "hydra").iterdir())  # one per launch, each with its own overrides
    assert len(hydra_dirs) == 4 and all((d / ".hydra" / "overrides.yaml").is_file() for d in hydra_dirs)
