"""The performance model against measured GPU rows: modelled beside measured decode ms/token, with the terms that
explain each.

    python -m experiments.validate_gpu              # the first GPU measurement (docs/gpu/, H200, runtime at
                                                    # 2f67c00 + the one-line fix) on the committed census of that
                                                    # code and the interim profile conf/hardware/h200_pcie5_measured
    python -m experiments.validate_gpu --rows OUT/latency.jsonl --profile OUT/profile.yaml --census live \
        --out OUT/latency_modelled.jsonl            # rows measured by this checkout's runtime (gpu_check.sh)
    python -m experiments.validate_gpu --census-from /path/to/checkout --write-census docs/gpu/census_2f67c00.json
    python -m experiments.validate_gpu --store docs/store   # both committed runs (RUNS), each row with the model
                                                    # beside it, the commit it ran at and the code changed since,
                                                    # as store rows for the report (make validate-gpu)

Measured rows are experiments/latency.py's JSONL lines (`row`, `decode_ms_median`, `h2d_bytes_per_token`, the
runtime's segment times). Each is modelled (infinigen/offload/perf.py) at its own batch, prompt, generated and
warm-up steps, on the model's shape and dtype, with the census of the code that ran it: `live` counts this
checkout's runtime; a census file keeps another version's (`--census-from DIR` runs this checkout's census and
model code against the runtime, methods and configs of the checkout DIR, in a temporary overlay, and writes what
the model reads of it, with the layers' kinds and the speculation point it declared). A gathering row is modelled
with the rows it moved: its measured host->device bytes per step over its gathering layers' rows.

Everything printed under "modelled" is the model's; "measured" columns are the row's own.

A store row (`--store`; metrics.benchmark = gpu, task gpu_latency) keeps the measured row as it is, the model's
ms/token, ratio and terms (`modelled_perf*`), the profile and census that modelled it and, where the device wrote
one, its own model of the row at the run (`modelled_at_run_ms_per_token`). Its meta says what ran it (`git_commit`:
neither committed run recorded one, both are 2f67c00 with uncommitted changes: `code`), and, as git gives them when
the rows are written (`modelled_commit`), the runtime's files changed since (`runtime_changed_since`, from
`code_since`) and the performance model's lines changed since that commit and since the store's CPU validation
(`model_changed_since`): the report cannot run git.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "docs" / "gpu"
FIRST_ROWS = GPU / "h200_opt13b_b20_p1920_g32.jsonl"
FIRST_CENSUS = GPU / "census_2f67c00.json"
FIRST_PROFILE = ROOT / "conf" / "hardware" / "h200_pcie5_measured.yaml"
# the 2f67c00 runtime gathers with ONE index_select on its one worker thread, at torch's intra-op thread count,
# which defaults to the host's physical cores: 16 on that H200 host (lscpu on a lent H200 of the same kind: 16
# cores, 1 thread per core; torch reported 16 intra-op threads: docs/gpu/run_20261204/gpu_check.log)
FIRST_GATHER_THREADS = 16
# the rows of experiments/latency.py at 2f67c00: row -> (conf/method, overrides, task overrides)
ROWS_2F67C00 = {
    "ideal": ("full", {}, {}),
    "offload": ("offload", {}, {}),
    "quant-int4": ("quant", {"bits": 4, "group_size": 64}, {}),
    "h2o": ("h2o", {"heavy": 0.1, "recent": 0.1}, {}),
    "infinigen": ("infinigen", {"alpha": 4.0, "partial_ratio": 0.2, "budget": 0.2}, {}),
}
WITHIN = 0.25
SECOND_ROWS = GPU / "run_20261204" / "latency.jsonl"
# the committed GPU runs as `--store` writes them: what ran them, on what, and how each is modelled. Neither run
# recorded its commit; both are this project's code on top of 2f67c00 with uncommitted changes:
RUNS = {
    FIRST_ROWS: {
        "run": "first run", "order": 1, "commit": "2f67c00284b1627c085ba623baaff043eb1535d3-dirty",
        "code": "2f67c00 + 1 line (select_evict.py:54: masked scores filled with the dtype's min)",
        # the runtime that ran is 2f67c00's but for that line: what changed after 2f67c00 did not run
        "since": "2f67c00", "also": None,
        "profile": FIRST_PROFILE, "census": FIRST_CENSUS, "gather_threads": FIRST_GATHER_THREADS, "at_run": None,
        "device": "NVIDIA H200 (143,771 MiB, PCIe 5.0 x16), 16 host cores", "threads": 16,
        "versions": {"torch": "2.11.0+cu130", "transformers": "5.24.0"},  # docs/gpu/h200_device.txt
        "measured": "2026-12-04", "log": "docs/gpu/README.md",
    },
    SECOND_ROWS: {
        "run": "run_20261204", "order": 2, "commit": "2f67c00284b1627c085ba623baaff043eb1535d3-dirty",
        "code": "2f67c00 + the uncommitted GPU rewrite (committed with two later changes as aed9c9d)",
        # the tree that ran was never committed: aed9c9d is it plus the two changes below, none of which ran
        "since": "aed9c9d",
        "also": "aed9c9d itself adds two changes made after the run (the gather on the fetch worker's intra-op "
                "threads; fewer ops per gathering layer)",
        # no census of the tree that ran was kept: this checkout's (live); the device's own model of that tree, on
        # the profile it had just measured, is in latency_modelled.jsonl
        "profile": ROOT / "conf" / "hardware" / "h200_pcie5_calibrated.yaml", "census": "live", "gather_threads": None,
        "at_run": GPU / "run_20261204" / "latency_modelled.jsonl",
        "device": "NVIDIA H200 (143,771 MiB, PCIe 5.0 x16), 16 host cores", "threads": 16,
        "versions": {"torch": "2.11.0+cu130", "transformers": "5.24.0"},  # gpu_check.log
        "measured": "2026-12-04", "log": "docs/gpu/run_20261204/gpu_check.log",
    },
}
# the performance model's own code (it reads a census; it never runs on the device), apart from the runtime's:
# perf.py and the modules it models with, the census and its counter, the paper's schedule
PERF_FILES = ("infinigen/offload/perf.py", "infinigen/offload/profile.py", "infinigen/offload/plan.py",
              "infinigen/offload/roofline.py", "infinigen/offload/clock.py")
MODEL_FILES = PERF_FILES + ("infinigen/offload/census.py", "infinigen/offload/op_counter.py",
                            "infinigen/offload/paper.py")
# where the code a GPU run executes lives: the runtime, the methods, the latency task
RUNTIME_PATHS = ("infinigen", "baselines", "experiments/latency.py")


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def row_table(census_file: dict | None) -> dict:
    """row name -> (conf/method, overrides, task overrides): the census file's, else experiments/latency.py's."""
    if census_file is not None:
        return {name: tuple(entry["row"]) for name, entry in census_file["rows"].items()}
    from experiments.latency import ROWS

    return ROWS


def model_cfg(name: str, dtype: str):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    cfg.dtype = dtype
    return cfg


def method_of(conf: str, overrides: dict):
    """A method instance from conf/method (no data folder: the model reads declarations, not calibration)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "method" / f"{conf}.yaml"), overrides)
    root = OmegaConf.create({"data_dir": None, "method": cfg})
    return instantiate(root.method)


class Declared:
    """A method as another version of the runtime declared it: the layers' kinds and the speculation point a
    census file recorded; everything else (codec widths, held counts, FLOPs) from this checkout's method."""

    def __init__(self, method, kinds: list[str], speculation_point: str | None):
        self._method, self._kinds, self._point = method, kinds, speculation_point

    def __getattr__(self, name):
        return getattr(self._method, name)

    @property
    def offload(self) -> str:
        kinds = set(self._kinds) - {"resident"}
        return kinds.pop() if kinds else "resident"

    @property
    def speculation_point(self) -> str:
        return self._point or "query"

    def offload_kind(self, layer) -> str:
        return self._kinds[layer.index]


def kinds_of(method, cfg, runtime: str) -> list[str]:
    from infinigen.offload.plan import Shape
    from infinigen.offload.runtime import layer_kind

    shape = Shape.of(cfg)
    return [layer_kind(method, shape.layer(i), runtime) for i in range(shape.layers)]


def fetched_fractions(row: dict, method, cfg, runtime: str) -> list[float] | None:
    """Per layer, what a gathering row fetched: its measured host->device bytes per step over its gathering
    layers' rows, as a kv_fraction (selected past + itself, over the mean context of its timed steps). Its
    `fetched_tokens_mean` averages in the dense layers' zeros (InfiniGen's layer 0: 377.8 of 387.5)."""
    from infinigen.offload.plan import Shape
    from infinigen.offload.plan import plan as layer_plan

    shape = Shape.of(cfg)
    plan = layer_plan(method, shape, runtime, row["prompt_len"] + row["gen_len"])
    gathering = [i for i, k in enumerate(plan.kinds) if k == "gather"]
    if not gathering:
        return None
    per_row = sum(plan.row_bytes[i] for i in gathering) * row["batch_size"] * shape.kv_heads
    selected = row["h2d_bytes_per_token"] / per_row
    warmup = row.get("gen_len", 0) - row.get("measured_steps", row.get("gen_len", 0))
    seen = row["prompt_len"] + 1 + (warmup + row["gen_len"] - 1) / 2
    f = (selected + 1) / seen
    return [f if k == "gather" else 1.0 for k in plan.kinds]


def model_row(row: dict, hw_cfg: dict, entry: dict, census_file: dict | None, host_gbps: float | None = None) -> dict:
    """The modelled metrics of one measured row (its census from `census_file`, else this checkout's)."""
    from infinigen.offload import perf
    from infinigen.offload.profile import hardware

    conf, overrides, task = entry
    runtime = task.get("runtime", "auto")
    cfg = model_cfg(row["model"], row.get("dtype", "float16"))
    method = method_of(conf, overrides)
    cen = None
    if census_file is not None:
        recorded = census_file["rows"][row["row"]]
        method = Declared(method, recorded["kinds"], recorded["speculation_point"])
        cen = recorded["census"]
    hw = hardware({**hw_cfg, **({"host_gbps": host_gbps} if host_gbps else {})})
    fractions = fetched_fractions(row, method, cfg, runtime)
    warmup = row["gen_len"] - row.get("measured_steps", row["gen_len"] - 2)
    steps = perf.modelled_steps(hw, cfg, method, runtime, row["batch_size"], row["prompt_len"], row["gen_len"],
                                fractions, cen, gather=task.get("gather", "host"))
    out = perf.summarize(steps, warmup, row["batch_size"])
    out["fetch_fraction"] = None if fractions is None else min(fractions)
    out["profile"] = hw.name
    return out


TERMS = ("compute_ms", "speculation_ms", "host_ms", "exposed_transfer_ms", "sync_wait_ms", "syncs_per_step",
         "join_wait_ms", "host_work_ms", "transfer_ms")
MEASURED_TERMS = ("attention_ms", "speculation_ms", "link_host_ms", "transfer_ms", "wait_ms")


def table(results: list[tuple[dict, dict]]) -> list[str]:
    """Markdown-ready lines: measured, modelled, ratio, the modelled terms and the measured segments."""
    lines = [f"{'row':<20} {'measured':>9} {'modelled':>9} {'ratio':>6}  modelled terms (ms): compute / speculation / "
             "host gather / exposed link / sync waits (syncs) / joins / host work; link, worker busy  |  measured: "
             "attention / speculation / host gather / link / wait"]
    for row, m in results:
        ratio = m["decode_ms_median"] / row["decode_ms_median"]
        lines.append(
            f"{row['row']:<20} {row['decode_ms_median']:>9.1f} {m['decode_ms_median']:>9.1f} {ratio:>6.2f}  "
            f"{m['compute_ms']:.1f} / {m['speculation_ms']:.1f} / {m['host_ms']:.1f} / "
            f"{m['exposed_transfer_ms']:.1f} / "
            f"{m['sync_wait_ms']:.1f} ({m['syncs_per_step']:.0f}) / {m['join_wait_ms']:.1f} / {m['host_work_ms']:.1f}; "
            f"{m['transfer_ms']:.1f}, worker {m['host_busy_ms']:.1f}  |  "
            + " / ".join(f"{row.get(k, 0) or 0:.1f}" for k in MEASURED_TERMS))
    return lines


def markdown(results: list[tuple[dict, dict]], header: str) -> list[str]:
    """The table as markdown, under the line saying what was modelled with what (for docs/speed.md)."""
    lines = [header.lstrip("# ") + ".", "",
             "| row | measured ms/token | modelled | modelled / measured | modelled terms (ms): compute / speculation / "
             "host gather / exposed link; sync waits (syncs) / joins / host work; link busy, worker busy | measured "
             "segments (ms): attention / speculation / host gather / link / wait |", "|---|---|---|---|---|---|"]
    for row, m in results:
        lines.append(
            f"| {row['row']} | {row['decode_ms_median']:.1f} | {m['decode_ms_median']:.1f} | "
            f"{m['decode_ms_median'] / row['decode_ms_median']:.2f} | {m['compute_ms']:.1f} / {m['speculation_ms']:.1f}"
            f" / {m['host_ms']:.1f} / {m['exposed_transfer_ms']:.1f}; {m['sync_wait_ms']:.1f} "
            f"({m['syncs_per_step']:.0f}) / {m['join_wait_ms']:.1f} / {m['host_work_ms']:.1f}; {m['transfer_ms']:.1f}, "
            f"{m['host_busy_ms']:.1f} | " + " / ".join(f"{row.get(k, 0) or 0:.1f}" for k in MEASURED_TERMS) + " |")
    return lines


def write_block(doc: str, key: str, lines: list[str]) -> None:
    """Replace the text between `<!-- validate_gpu:KEY -->` and `<!-- /validate_gpu:KEY -->` in `doc`."""
    path = Path(doc)
    text = path.read_text()
    start, end = f"<!-- validate_gpu:{key} -->", f"<!-- /validate_gpu:{key} -->"
    if start not in text or end not in text:
        raise SystemExit(f"error: --markdown: {doc} has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    path.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1])


# ----------------------------------------------------------------------------------------------- census files


def dump_census(path: str, rows: list[dict], table_: dict) -> None:
    """(In the checkout whose runtime is modelled) the census the model reads for each row, its declarations."""
    from infinigen.offload import census, perf

    census.CACHE = Path(tempfile.mkdtemp(prefix="census-"))
    out = {"rows": {}}
    for row in rows:
        if row["row"] in out["rows"] or row["row"] not in table_:
            continue
        conf, overrides, task = table_[row["row"]]
        runtime = task.get("runtime", "auto")
        cfg = model_cfg(row["model"], row.get("dtype", "float16"))
        method = method_of(conf, overrides)
        kinds = kinds_of(method, cfg, runtime)
        print(f"census of {row['row']} ({conf}, {row['model']} {cfg.dtype})", file=sys.stderr, flush=True)
        cen = perf.census_of(cfg, method, runtime, row["batch_size"], kinds)
        out["rows"][row["row"]] = {
            "row": [conf, overrides, task], "model": row["model"], "dtype": str(cfg.dtype), "kinds": kinds,
            "speculation_point": getattr(method, "speculation_point", None) if "gather" in kinds else None,
            "census": {m: [{seg: round(v, 4) for seg, v in layer.items()} for layer in cen[m]] for m in cen},
        }
    Path(path).write_text(json.dumps(out, separators=(",", ":")) + "\n")


def census_from(checkout: Path, rows: list[str], write: str, table_name: str) -> None:
    """Runs this checkout's census and model code against `checkout`'s runtime, methods and configs (a temporary
    overlay of the two), writing the census file `write`."""
    checkout = checkout.resolve()
    overlay = Path(tempfile.mkdtemp(prefix="census-overlay-"))
    try:
        for folder in ("infinigen", "baselines", "conf"):
            shutil.copytree(checkout / folder, overlay / folder, ignore=shutil.ignore_patterns("__pycache__"))
        for f in ("infinigen/offload/census.py", "infinigen/offload/op_counter.py", *PERF_FILES):
            shutil.copy(ROOT / f, overlay / f)
        (overlay / "experiments").mkdir()
        (overlay / "experiments" / "__init__.py").write_text("")
        shutil.copy(Path(__file__), overlay / "experiments" / "validate_gpu.py")
        if (checkout / "experiments" / "latency.py").is_file():  # its ROWS
            shutil.copy(checkout / "experiments" / "latency.py", overlay / "experiments" / "latency.py")
        commit = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True,
                                text=True).stdout.strip()
        diff = subprocess.run(["git", "-C", str(checkout), "diff", "--stat"], capture_output=True, text=True).stdout
        out = Path(write).resolve()
        env = {"PYTHONPATH": str(overlay), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
        subprocess.run([sys.executable, "-m", "experiments.validate_gpu", "--dump-census", str(out), "--table",
                        table_name, "--rows", *[str(Path(r).resolve()) for r in rows]], cwd=overlay, env=env,
                       check=True)
        data = json.loads(out.read_text())
        data["code"] = {"checkout": commit, "diff": diff.strip(), "census_and_model": "this checkout's census.py and "
                        "perf.py over that checkout's runtime, methods and configs"}
        out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"-> {out} ({commit})")
    finally:
        shutil.rmtree(overlay, ignore_errors=True)


def validate(rows: list[str] | None = None, profile: str | None = None, census: str | None = None,
             gather_threads: int | None = None) -> tuple[list[tuple[dict, dict]], str]:
    """([(measured row, modelled metrics)], a header line): `main` without the printing. None: the first GPU
    measurement's rows, its census file, the interim profile and the 2f67c00 runtime's gather threads."""
    import yaml

    first = rows is None
    rows_paths = rows or [str(FIRST_ROWS)]
    profile_path = Path(profile or FIRST_PROFILE)
    hw_cfg = yaml.safe_load(profile_path.read_text())
    census_arg = census or (str(FIRST_CENSUS) if first else "live")
    census_file = None if census_arg == "live" else json.loads(Path(census_arg).read_text())
    table_ = row_table(census_file)
    # (a profile without the per-thread table, e.g. a datasheet one, keeps its own host_gbps)
    threads = gather_threads or (FIRST_GATHER_THREADS if first and hw_cfg.get("host_gbps_threads") else None)
    host_gbps = None
    if threads:
        # that runtime gathered beside a busy launching thread: a profile that measured the gather so is read first
        rates = {**(hw_cfg.get("host_gbps_threads") or {}), **(hw_cfg.get("host_gbps_threads_busy") or {})}
        if threads not in rates:
            raise ValueError(f"--gather-threads {threads}: the profile's host_gbps_threads has {sorted(rates)}")
        host_gbps = rates[threads]
    measured = [r for r in read_rows(rows_paths) if r.get("row") in table_]
    code = ("this checkout's" if census_file is None
            else f"{census_arg} ({census_file.get('code', {}).get('checkout', '?')})")
    header = (f"# {len(measured)} measured rows ({', '.join(rows_paths)}); profile {profile_path.name}; census {code}"
              + (f"; host gather at {threads} threads: {host_gbps} GB/s read + written" if threads else ""))
    return [(row, model_row(row, hw_cfg, table_[row["row"]], census_file, host_gbps)) for row in measured], header


# ----------------------------------------------------------------------------------------------- store rows


def git(*args: str) -> str | None:
    """git's output in this checkout; None where git or the history it needs is missing."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def modelled_commit() -> str:
    """HEAD, `-dirty` when a file the modelled numbers read (runtime, methods, configs, this script) is changed."""
    head = (git("rev-parse", "HEAD") or "").strip() or "unknown"
    dirty = (git("status", "--porcelain", "--untracked-files=no", "--", *RUNTIME_PATHS, "conf",
                 "experiments/validate_gpu.py") or "").strip()
    return head + ("-dirty" if dirty else "")


def runtime_changed(since: str) -> list[str] | None:
    """The runtime's and the methods' files (the performance model's aside) changed from `since` to HEAD (None:
    git cannot tell, e.g. a checkout without that commit)."""
    names = git("diff", "--name-only", since, "HEAD", "--", *RUNTIME_PATHS)
    return None if names is None else sorted(n for n in names.split() if n not in MODEL_FILES)


def model_changed(since: str) -> dict[str, list[int]] | None:
    """The performance model's files changed from `since` to HEAD: {file: [lines added, lines deleted]} (None: git
    cannot tell)."""
    text = git("diff", "--numstat", since, "HEAD", "--", *MODEL_FILES)
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        added, deleted, name = line.split("\t")
        out[name] = [int(added), int(deleted)]
    return out


def cpu_validation_commits(results: str | Path) -> list[str]:
    """The commits (7 hex digits) of the store's CPU validation rows (experiments/validate_perf.py)."""
    from analysis.store import rows_dir

    found = set()
    for path in rows_dir(results).glob("*.jsonl"):
        first = path.read_text().split("\n", 1)[0]
        if '"validation_point"' not in first:
            continue
        row = json.loads(first)
        if "validation_point" in (row.get("metrics") or {}):
            meta = row.get("meta") or {}
            found |= {c[:7] for c in (meta.get("git_commit"), meta.get("measured_commit")) if isinstance(c, str)}
    return sorted(found)


def rel(path) -> str:
    path = Path(path)
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def gpu_rows(source: Path, run: dict, results: str | Path) -> list[dict]:
    """One store row per measured row of a committed GPU run: the row as measured, the model's number beside it
    (this checkout's model, the run's profile and census), the commit it ran at, and what changed since."""
    census_arg = str(run["census"])
    census_file = None if census_arg == "live" else json.loads(Path(census_arg).read_text())
    table_ = row_table(census_file)
    results_, header = validate([str(source)], str(run["profile"]), census_arg, run["gather_threads"])
    at_run = {r["row"]: r for r in read_rows([str(run["at_run"])])} if run["at_run"] else {}
    census = ("live: this checkout's runtime counted by its census (no census of the code that ran was kept)"
              if census_file is None else
              f"{rel(census_arg)}: the code that ran ({census_file.get('code', {}).get('checkout', '?')}), counted by "
              "this checkout's census")
    since = {c: model_changed(c) for c in sorted({run["since"], *cpu_validation_commits(results)})}
    meta = {"git_commit": run["commit"], "code": run["code"], "code_since": run["since"], "code_also": run["also"],
            "device": "cuda", "gpu": run["device"], "threads": run["threads"], "versions": run["versions"],
            "measured": run["measured"], "log": run["log"], "modelled_commit": modelled_commit(),
            "runtime_changed_since": runtime_changed(run["since"]), "model_changed_since": since,
            "cpu_validation_commits": cpu_validation_commits(results)}
    out = []
    for index, (row, m) in enumerate(results_):
        conf, overrides, task = table_[row["row"]]
        measured = {k: v for k, v in row.items() if k != "row"}
        shape = {k: row[k] for k in ("batch_size", "prompt_len", "gen_len", "measured_steps") if k in row}
        config = {"benchmark": "gpu", "source": rel(source), "row": row["row"],
                  "model": {"name": row["model"], "dtype": row.get("dtype"), "random_init": row.get("random_init")},
                  "method": {"name": conf, **overrides}, "task": {"name": "gpu_latency", **shape, **task},
                  "profile": rel(run["profile"]), "census": census_arg if census_file is None else rel(census_arg),
                  "gather_threads": run["gather_threads"]}
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
        device = at_run.get(row["row"], {})
        metrics = {**measured, "benchmark": "gpu", "run": run["run"], "run_order": run["order"],
                   "source": rel(source), "gpu_row": row["row"], "row_index": index,
                   "modelled_perf_ms_per_token": m["decode_ms_median"],
                   "modelled_perf_to_measured": m["decode_ms_median"] / row["decode_ms_median"],
                   "modelled_perf": m, "modelled_profile": rel(run["profile"]), "modelled_census": census,
                   "modelled_gather_threads": run["gather_threads"], "modelled_header": header.replace(
                       str(ROOT) + "/", "").lstrip("# "),
                   "modelled_at_run_ms_per_token": device.get("modelled_perf_ms_per_token"),
                   "modelled_at_run_profile": (device.get("modelled_perf") or {}).get("profile")}
        out.append({"config_hash": digest, "model": row["model"], "method": conf, "task": "gpu_latency", "data": {},
                    "method_params": {"name": conf, **overrides},
                    "task_params": {"name": "gpu_latency", **shape, **task}, "metrics": metrics, "config": config,
                    "meta": meta})
    return out


def write_store(results: str | Path) -> list[Path]:
    """Each committed GPU run's rows into the store `results` (one file per row: `<hash>__<UTC time>.jsonl`), as
    script rows (metrics.benchmark = gpu; the report's "C7. Speed measured on a GPU"). A row whose file already
    holds the same text is left alone; older files of a row, and rows of these runs no longer produced (another
    profile or census), are removed."""
    from datetime import datetime, timezone

    from analysis.store import rows_dir

    folder = rows_dir(results)
    folder.mkdir(parents=True, exist_ok=True)
    written, keep = [], set()
    for source, run in RUNS.items():
        for row in gpu_rows(source, run, results):
            text = json.dumps(row, sort_keys=True, default=str) + "\n"
            digest = row["config_hash"]
            files = sorted(folder.glob(f"{digest}__*.jsonl"))
            same = [f for f in files if f.read_text() == text]
            if same:
                keep.add(same[-1].name)
            else:
                stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
                path = folder / f"{digest}__{stamp}.jsonl"
                path.write_text(text)
                written.append(path)
                keep.add(path.name)
    sources = {rel(source) for source in RUNS}
    for path in sorted(folder.glob("*.jsonl")):
        if path.name in keep or '"benchmark": "gpu"' not in (first := path.read_text().split("\n", 1)[0]):
            continue
        if (json.loads(first).get("metrics") or {}).get("source") in sources:
            path.unlink()  # an older file of a row, or a row these runs no longer produce
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=None, help="measured latency JSONL (default: docs/gpu's batch-20 rows)")
    p.add_argument("--profile", default=None, help="hardware profile (default: conf/hardware/h200_pcie5_measured.yaml)")
    p.add_argument("--census", default=None,
                   help="census file of the code that ran the rows, or `live` (this checkout's); default: "
                        "docs/gpu/census_2f67c00.json for the default rows, else live")
    p.add_argument("--gather-threads", type=int, default=None,
                   help="price the host gather at the profile's host_gbps_threads entry for this many threads "
                        f"(default: {FIRST_GATHER_THREADS} for the 2f67c00 rows, else the profile's host_gbps)")
    p.add_argument("--out", default=None, help="write each measured row with its modelled_* metrics (JSONL)")
    p.add_argument("--markdown", default=None, metavar="DOC",
                   help="also write the table into DOC's <!-- validate_gpu:ROWS --> block (ROWS: the rows file)")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="instead: write every committed GPU run (RUNS: docs/gpu's batch-20 rows and run_20261204) "
                        "with the model beside each row into the results store DIR (the report reads docs/store)")
    p.add_argument("--census-from", default=None, help="a checkout whose runtime the census file describes")
    p.add_argument("--write-census", default=None, help="with --census-from: the census file to write")
    p.add_argument("--dump-census", default=None, help=argparse.SUPPRESS)
    p.add_argument("--table", default="latency", choices=("latency", "2f67c00"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    first = args.rows is None
    rows_paths = args.rows or [str(FIRST_ROWS)]
    if args.dump_census:
        dump_census(args.dump_census, read_rows(rows_paths), ROWS_2F67C00 if args.table == "2f67c00" else
                    row_table(None))
        return 0
    if args.store:
        if args.rows or args.profile or args.census or args.markdown or args.out:
            p.error("--store models the committed runs (RUNS) each as it was run; a new run: add it to RUNS")
        for path in write_store(args.store):
            print(f"-> {path}")
        return 0
    if args.census_from:
        if not args.write_census:
            p.error("--census-from needs --write-census")
        census_from(Path(args.census_from), rows_paths, args.write_census, "2f67c00" if first else "latency")
        return 0

    try:
        results, header = validate(args.rows, args.profile, args.census, args.gather_threads)
    except ValueError as err:
        p.error(str(err))
    print(header, flush=True)
    for line in table(results):
        print(line)
    ratios = [m["decode_ms_median"] / r["decode_ms_median"] for r, m in results]
    inside = sum(abs(x - 1) <= WITHIN for x in ratios)
    print(f"# {inside} of {len(ratios)} rows within +-{WITHIN:.0%}; modelled / measured: "
          + ", ".join(f"{r['row']} {x:.2f}" for (r, _), x in zip(results, ratios)))
    if args.markdown:
        key = str(Path(rows_paths[0]).resolve().relative_to(ROOT)) if Path(rows_paths[0]).resolve().is_relative_to(
            ROOT) else rows_paths[0]
        header = header.replace(str(ROOT) + "/", "")
        write_block(args.markdown, key, markdown(results, header) + ["", f"{inside} of {len(ratios)} rows within "
                                                                     f"+-{WITHIN:.0%}."])
        print(f"-> {args.markdown} ({key})")
    if args.out:
        with open(args.out, "w") as f:
            for row, m in results:
                # beside the measured row, under names no measured metric has (a CPU row's modelled_* are its link
                # model's): the performance model's ms/token, its ratio to the measured one, and all its terms
                f.write(json.dumps({**row, "modelled_perf_ms_per_token": m["decode_ms_median"],
                                    "modelled_perf_to_measured": m["decode_ms_median"] / row["decode_ms_median"],
                                    "modelled_perf": m}) + "\n")
        print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
