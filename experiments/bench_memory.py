"""Peak host memory of evaluation against the model's own forward, per sequence length (CPU; docs/scaling.md).

    python experiments/bench_memory.py                       # smollm2-135m, full, 1k/2k/4k/8k
    python experiments/bench_memory.py --lengths 1024 8192 --method h2o

Each measurement is a fresh process, so its peak RSS (the kernel's ru_maxrss, read with os.wait4) is its own:
* `ppl`: `python run.py model=M method=X task=ppl task.seq_len=L task.max_windows=1` (one window of WikiText-2
  test: the sim forward, the log-probs and the decode-mode cache measurement of the task);
* `forward`: the same model loaded the same way (infinigen.adapter.load), then one plain transformers forward
  `model(ids)` of L tokens with its SDPA attention (what the model itself needs to score L tokens: its logits
  included); `loaded` is the RSS of that process before the forward (model, libraries).
Prints one row per length and the slope of each column from the shortest to the longest length in MB/token, and
the ppl of each run; with `--results DIR` each length is also a row of that store (task `memory`), which
`make report` turns into the evaluation-memory section of docs/results.md (`--results docs/store` for the
committed copy). RSS does not depend on the machine's load, time does: run it on an idle machine or with
`nice`, one measurement at a time (this script never runs two at once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--method", default="full", help="conf/method name of the ppl runs")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or str(ROOT.parent / "shared" / "data"))
    p.add_argument("--results", default=None, help="also write one row per length into this results store")
    p.add_argument("--forward-child", type=int, default=None, help=argparse.SUPPRESS)  # internal: one forward
    return p.parse_args(argv)


def peak_rss(cmd: list[str]) -> tuple[int, str]:
    """(peak RSS in bytes, stdout) of one child process; raises if it fails."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    out, err = proc.communicate()  # waits with waitpid: the child is reaped there, so take its usage from the OS
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    marker = [line for line in out.splitlines() if line.startswith("PEAK_RSS_KB ")]
    return int(marker[-1].split()[1]) * 1024, out


def rss_wrapper(argv: list[str]) -> list[str]:
    """The command run under a tiny wrapper that prints its child's own peak RSS (os.wait4's rusage)."""
    code = ("import os, sys, subprocess; p = subprocess.Popen(sys.argv[1:]); _, status, usage = os.wait4(p.pid, 0); "
            "print('PEAK_RSS_KB', usage.ru_maxrss, flush=True); sys.exit(os.waitstatus_to_exitcode(status))")
    return [sys.executable, "-c", code, *argv]


def ppl_run(model: str, method: str, length: int, data_dir: str) -> tuple[int, float]:
    """(peak RSS bytes, ppl) of the ppl task at `length` tokens, one window, through run.py."""
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as results:
        cmd = [sys.executable, "run.py", f"model={model}", f"method={method}", "task=ppl", f"task.seq_len={length}",
               "task.max_windows=1", f"data_dir={data_dir}", f"results_dir={results}", "hydra.run.dir=" + results]
        rss, _ = peak_rss(rss_wrapper(cmd))
        (rows,) = list(Path(results, "rows").glob("*.jsonl"))
        return rss, json.loads(rows.read_text().splitlines()[0])["metrics"]["ppl"]


def forward_run(model: str, length: int, data_dir: str) -> tuple[int, int, float]:
    """(peak RSS bytes, RSS after loading, ppl of the model's own logits) of one plain forward at `length`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", model, "--data-dir", data_dir,
           "--forward-child", str(length)]
    rss, out = peak_rss(rss_wrapper(cmd))
    loaded, ppl = next(line.split()[1:] for line in out.splitlines() if line.startswith("LOADED_RSS_KB "))
    return rss, int(loaded) * 1024, float(ppl)


def forward_child(model_name: str, length: int, data_dir: str) -> None:
    """Runs in its own process: load, one SDPA forward of the first `length` WikiText-2 test tokens."""
    sys.path.insert(0, str(ROOT))
    import torch
    from omegaconf import OmegaConf

    from infinigen import adapter
    from infinigen.corpora import corpus_text

    model, tokenizer = adapter.load(OmegaConf.load(ROOT / "conf" / "model" / f"{model_name}.yaml"))
    ids = adapter.encode(tokenizer, corpus_text("wikitext2", data_dir), model.config.vocab_size)[:length][None]
    loaded = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmRSS:")))
    with torch.inference_mode(), adapter.attn_implementation(model, "sdpa"):
        logits = model(ids, use_cache=False).logits  # (1, t, vocab): the model's own scoring
        nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    print("LOADED_RSS_KB", loaded, float(nll.exp()), flush=True)


def write_row(results: str, args, length: int, task_rss: int, fwd_rss: int, loaded: int, task_ppl: float,
              fwd_ppl: float) -> None:
    """One store row: the peak RSS of the ppl task and of the model's own forward at `length` tokens."""
    import hashlib
    import platform
    from datetime import datetime, timezone

    import torch

    sys.path.insert(0, str(ROOT))
    from analysis import store
    from experiments import identity

    config = {"benchmark": "memory", "model": {"name": args.model}, "method": {"name": args.method},
              "task": {"name": "ppl", "seq_len": length, "max_windows": 1, "dataset": "wikitext2"}}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    metrics = {"benchmark": "memory", "seq_len": length, "task_peak_gb": task_rss / 1e9,
               "forward_peak_gb": fwd_rss / 1e9, "loaded_gb": loaded / 1e9, "ppl": task_ppl, "forward_ppl": fwd_ppl}
    meta = {"git_commit": identity.git_commit(), "versions": identity.versions(), "device": "cpu",
            "threads": torch.get_num_threads(), "host": platform.node(),
            "finished": datetime.now(timezone.utc).isoformat()}
    row = {"config_hash": digest, "model": args.model, "method": args.method, "task": "memory", "data": {},
           "method_params": {"name": args.method}, "task_params": {"name": "memory", "seq_len": length},
           "metrics": metrics, "config": config, "meta": meta}
    store.append_rows(results, digest, [row])


def slope(lengths: list[int], values: list[float]) -> float:
    """MB per token from the shortest to the longest length."""
    return (values[-1] - values[0]) / (lengths[-1] - lengths[0]) / MB


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.forward_child is not None:
        forward_child(args.model, args.forward_child, args.data_dir)
        return
    lengths = sorted(args.lengths)
    rows = []
    print(f"peak RSS, {args.model}: ppl task (method={args.method}, one window) vs the model's own SDPA forward")
    print(f"{'tokens':>7} {'ppl task GB':>12} {'forward GB':>11} {'loaded GB':>10} {'ppl (task)':>12} "
          f"{'ppl (forward)':>14}")
    for length in lengths:
        task_rss, task_ppl = ppl_run(args.model, args.method, length, args.data_dir)
        fwd_rss, loaded, fwd_ppl = forward_run(args.model, length, args.data_dir)
        rows.append((task_rss, fwd_rss))
        print(f"{length:>7} {task_rss / 1e9:>12.2f} {fwd_rss / 1e9:>11.2f} {loaded / 1e9:>10.2f} {task_ppl:>12.6f} "
              f"{fwd_ppl:>14.6f}", flush=True)
        if args.results:
            write_row(args.results, args, length, task_rss, fwd_rss, loaded, task_ppl, fwd_ppl)
    if len(lengths) > 1:
        print(f"slope {lengths[0]}..{lengths[-1]} tokens: ppl task {slope(lengths, [r[0] for r in rows]):.3f} MB/token, "
              f"forward {slope(lengths, [r[1] for r in rows]):.3f} MB/token")


if __name__ == "__main__":
    main()
