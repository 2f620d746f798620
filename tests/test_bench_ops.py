"""The op and host-sync census (experiments/bench_ops.py): its counter (infinigen/offload/op_counter.py
SyncCounter), a smoke run of every method, and THE GATE.

THE GATE (`test_gate_*`): the offloading runtime's steady decode step, on the thread that launches kernels, has
no host synchronisation for the paper's rows (full under runtime ideal and auto, offload, quant, H2O, InfiniGen)
on tiny-llama-gqa and tiny-opt, and InfiniGen dispatches as many ops per layer-step at prompt 2048 as at 512 (up
to 5%) and at batch 8 as at batch 1. It fails until the runtime rewrite that removes those syncs lands; its
message names each sync, where it was asked for (file:line) and how often. Not xfail'd: a red gate is the point.
"""

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import pytest
import torch

from conftest import METHODS
from experiments import bench_ops as B
from infinigen.offload.op_counter import SyncCounter

STEPS, SKIP = 12, 2  # decode steps per gate point; steady: steps 2..10 (H2O evicts at some steps only)
# ragged selections (batch > 1); the prompt is short (the syncs are a property of the code path; a 512-token
# prefill of 8 rows took ~3 s per point here): InfiniGen's points below are the sizes
GATE_BATCH, GATE_PROMPT = 8, 128
SIZES = [(b, p) for b in (1, 8) for p in (512, 2048)]  # the InfiniGen points


def counted(fn, inference: bool = True) -> SyncCounter:
    counter = SyncCounter("cpu")
    with torch.inference_mode(inference), counter:
        fn()
    return counter


x = torch.randn(4, 6)
mask = x > 0
PLANTED = {
    "int(t)": lambda: int(x.sum()),
    "float(t)": lambda: float(x[0, 0]),
    "t.item()": lambda: x.max().item(),
    "bool(t)": lambda: bool(mask.any()),
    "if t:": lambda: 1 if mask.all() else 0,
    "t.nonzero()": lambda: mask.nonzero(),
    "torch.where(mask)": lambda: torch.where(mask),
    "x[mask]": lambda: x[mask],
    "x[mask] = 0": lambda: x.clone().__setitem__(mask, 0.0),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(mask.long()),
    "repeat_interleave(tensor)": lambda: x.repeat_interleave(torch.tensor([1, 2, 1, 1]), dim=0),
    "torch.equal": lambda: torch.equal(x, x),
    "t.cpu()": lambda: x.cpu(),
    "t.to('cpu')": lambda: x.to("cpu"),
    "t.tolist()": lambda: mask.sum(-1).tolist(),
}
STATIC = {
    "topk": lambda: x.topk(2, dim=-1),
    "torch.where(mask, a, b)": lambda: torch.where(mask, x, 0.0),
    "masked_fill": lambda: x.masked_fill(~mask, float("-inf")),
    "gather / index_select / scatter": lambda: (x.gather(-1, x.argsort(-1)), x.index_select(0, torch.tensor([0, 2])),
                                                 torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)),
    "x[long index]": lambda: x[torch.tensor([0, 2])],
    "sort / cumsum / argmax": lambda: (x.sort(-1), x.cumsum(-1), x.argmax(-1)),
    "repeat_interleave(int)": lambda: x.repeat_interleave(2, dim=0),
    "repeat_interleave(tensor, output_size)": lambda: x.repeat_interleave(torch.tensor([1, 2, 1, 1]), dim=0,
                                                                           output_size=5),
    "nonzero_static": lambda: torch.nonzero_static(mask, size=24),
    "t.to(t.device)": lambda: x.to(x.device, torch.float64),
    "einsum / sdpa": lambda: (torch.einsum("ij,kj->ik", x, x),
                              torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])),
}


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "grad_mode"])
@pytest.mark.parametrize("case", PLANTED)
def test_counter_finds_a_planted_sync(case, inference):
    counter = counted(PLANTED[case], inference)
    assert counter.sync_total == 1, (case, dict(counter.syncs))
    (site,) = counter.sites
    assert site.split(" @ ")[1].startswith("tests/test_bench_ops.py:"), site  # where it was asked for


@pytest.mark.parametrize("case", STATIC)
def test_counter_counts_no_sync_in_static_shape_code(case):
    counter = counted(STATIC[case])
    assert counter.sync_total == 0, (case, dict(counter.syncs))
    assert counter.ops > 0


def test_counter_counts_composite_ops_by_what_they_run():
    """Under inference_mode a composite op reaches the mode whole; it is counted by its decomposition, as
    outside inference_mode, so both count the same ops."""
    def fn():
        torch.einsum("ij,kj->ik", x, x).repeat_interleave(2, dim=0)

    assert counted(fn, inference=True).ops == counted(fn, inference=False).ops > 2


def test_counter_counts_only_its_own_thread_and_main_thread_waits():
    """Dispatch modes are thread-local: a worker's ops and syncs are host-side work, not counted; the main
    thread waiting for the worker's Future is a link wait."""
    with ThreadPoolExecutor(1) as pool:
        counter = SyncCounter("cpu")
        with counter:
            fut = pool.submit(lambda: (int(x.sum()), x.nonzero(), x.cpu(), wait_in_a_worker()))
            fut.result()
            y = x + 1
        assert counter.sync_total == 0 and dict(counter.waits) == {"Future.result": 1}
        assert counter.ops == 1 and y.shape == x.shape
    assert "cpu" not in vars(torch.Tensor)  # the Python-level hooks are gone


def wait_in_a_worker():
    """A Future waited on by a thread other than the counting one is not the main thread's wait."""
    with ThreadPoolExecutor(1) as inner:
        return inner.submit(lambda: 1).result()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_counter_on_cuda_counts_device_syncs_only():
    dev = torch.randn(4, 6, device="cuda")
    pinned = torch.empty(4, 6, pin_memory=True)
    cases = {"item of a device tensor": (lambda: dev.sum().item(), 1), "cpu() of a device tensor": (dev.cpu, 1),
             "item of a host tensor": (lambda: x.sum().item(), 0),
             "non_blocking copy into pinned memory": (lambda: pinned.copy_(dev, non_blocking=True), 0),
             "blocking copy to the host": (lambda: pinned.copy_(dev), 1), "nonzero on the device": (dev.nonzero, 1)}
    for name, (fn, syncs) in cases.items():
        counter = SyncCounter("cuda")
        with torch.inference_mode(), counter:
            fn()
        assert counter.sync_total == syncs, (name, dict(counter.syncs))
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- runs


@lru_cache(maxsize=None)
def model(name: str):
    from infinigen import adapter

    return adapter.load(B.model_config(name, positions=max(p for _, p in SIZES) + STEPS + 1))[0]


@lru_cache(maxsize=None)
def method(name: str):
    return B.build_method(name, [], B.parse_args([]).data_dir)


@lru_cache(maxsize=None)
def point(model_name: str, name: str, runtime: str, batch: int, prompt: int) -> dict:
    return B.decode_point(model(model_name), method(name), runtime, batch, prompt, STEPS, SKIP)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_through_the_census(name):
    """Each conf/method at one small point: a decode point through the runtime and a sim forward."""
    m = B.decode_point(model("tiny-llama-gqa"), method(name), "auto", 2, 32, 4, 1)
    assert m["steps_counted"] == 2 and m["ops_per_step"] > 0 and m["layers"] == 3
    assert m["ops_per_layer_step"] == pytest.approx(m["ops_per_step"] / 3)
    s = B.sim_point(model("tiny-llama-gqa"), method(name), 32, dense_rows=16 if method(name).needs_prompt else 0)
    assert s["ops"] > 0 and s["syncs"] == sum(s["sync_ops"].values())


def test_rows_land_in_the_store_and_the_report_reads_them(tmp_path):
    """The command line, one method: decode and sim rows in a results store, which analysis/ops.py tabulates."""
    from analysis import ops, store

    args = ["--methods", "full", "--models", "tiny-opt", "--prompts", "32", "--batches", "1", "--steps", "4",
            "--skip", "1", "--sim-models", "tiny-opt", "--sim-tokens", "32", "64", "--results", str(tmp_path)]
    points = B.main(args)
    assert [(p["mode"], p.get("runtime")) for p in points] == [("decode", "auto"), ("decode", "ideal"),
                                                               ("sim", None), ("sim", None)]
    rows = store.load(tmp_path, strict=True)
    assert len(rows) == 4 and set(rows["task"]) == {"ops"} and rows["meta.git_commit"].notna().all()
    decode = ops.decode_table(ops.decode_rows(rows))
    assert list(decode["runtime"]) == ["ideal", "auto"] and "ops/layer 1 x 32" in decode
    assert len(ops.sim_table(ops.sim_rows(rows))) == 1


# ----------------------------------------------------------------------------------------------- sim forwards

SIM_SIZES = (1024, 2048)  # the lengths: one sim forward each on tiny-llama-gqa (3 layers)
GROWTH = 1.1  # a closed-form method's ops at 2048 tokens <= 1.1 x its ops at 1024
PER_ROW = 12  # H2O / TOVA: ops per decoded row of the forward (all 3 layers) between 1024 and 2048 tokens


@lru_cache(maxsize=None)
def sim(name: str, tokens: int) -> dict:
    m = method(name)
    return B.sim_point(model("tiny-llama-gqa"), m, tokens, dense_rows=tokens // 2 if m.needs_prompt else 0)


@pytest.mark.parametrize("name", METHODS)
def test_sim_forward_syncs_the_host_only_in_transformers(name):
    """No method's sim forward reads a device value back: the one sync left is transformers' packed-sequence
    check of the position ids (bench_ops.SIM_MASK_SYNC), which full attention's forward makes too."""
    for n in SIM_SIZES:
        s = sim(name, n)
        ours = {site: k for site, k in s["sync_sites"].items() if not site.split(" @ ")[1].startswith(B.SIM_MASK_SITE)}
        assert s["sync_ops"] == B.SIM_MASK_SYNC and not ours, f"{name} at {n} tokens: {s['sync_sites']}"


@pytest.mark.parametrize("name", [m for m in METHODS if m not in B.SEQUENTIAL])
def test_closed_form_sim_ops_do_not_grow_with_the_sequence(name):
    ops = {n: sim(name, n)["ops"] for n in SIM_SIZES}
    assert ops[2048] <= GROWTH * ops[1024], f"{name}: {ops[2048]} ops at 2048 tokens > {GROWTH} x {ops[1024]} at 1024"


@pytest.mark.parametrize("name", B.SEQUENTIAL)
def test_sequential_eviction_ops_per_decoded_row(name):
    """H2O and TOVA replay their rows in order (exact semantics), each row's step a few static-shape ops:
    at most PER_ROW per decoded row over the model's 3 layers (the Python-loop version dispatched ~35-90)."""
    per_row = (sim(name, 2048)["ops"] - sim(name, 1024)["ops"]) / 1024
    assert per_row <= PER_ROW, f"{name}: {per_row:.2f} ops per decoded row (3 layers) > {PER_ROW}"


def test_gpu_sim_check_dry_run_writes_its_rows(tmp_path):
    """experiments/gpu_check.sh --sim's command (bench_sim with rows into JSONL) at toy sizes on CPU: every label
    a row per length, H2O / TOVA with capture falling back to the eager replay (same kv_fraction), x full."""
    import json

    from experiments import bench_sim

    out = tmp_path / "sim_seconds.jsonl"
    bench_sim.main(["--device", "cpu", "--model", "tiny-llama-gqa", "--random-init", "--tokens", "48", "--scaling",
                    "32", "--repeats", "1", "--prompt-for-compressors", "--capture-variants", "--methods", "full",
                    "h2o", "snapkv", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    labels = ["model sdpa", "model eager", "full", "h2o", "h2o capture=graph", "snapkv", "h2o capture=compile"]
    assert [(r["tokens"], r["label"]) for r in rows] == [(n, label) for n in (48, 32) for label in labels]
    assert all(r["seconds"] > 0 and r["bench"] == "sim_seconds" and r["random_init"] for r in rows)
    by = {(r["tokens"], r["label"]): r for r in rows}
    for n in (48, 32):
        assert by[(n, "full")]["x_full"] == 1.0 and by[(n, "snapkv")]["dense_rows"] == n // 2
        assert not any(by[(n, f"h2o capture={c}")]["capture_used"] for c in ("graph", "compile"))  # no CUDA here
        assert by[(n, "h2o capture=graph")]["kv_fraction"] == by[(n, "h2o")]["kv_fraction"] < 1
    skipped = tmp_path / "skipped.jsonl"
    bench_sim.main(["--device", "cpu", "--model", "tiny-llama-gqa", "--random-init", "--tokens", "32", "--scaling",
                    "--repeats", "1", "--methods", "full", "--budget", "0", "--out", str(skipped)])
    assert all("skipped" in json.loads(line) for line in skipped.read_text().splitlines())


# ----------------------------------------------------------------------------------------------- THE GATE


def where(m: dict) -> str:
    return "; ".join(f"{site}: {n:.3g}/step" for site, n in m["sync_sites"].items())


@pytest.mark.parametrize("model_name", B.DECODE_MODELS)
@pytest.mark.parametrize("name,runtime", B.PAPER_ROWS, ids=[f"{n}-{r}" for n, r in B.PAPER_ROWS])
def test_gate_paper_rows_never_sync_the_host_in_a_decode_step(name, runtime, model_name):
    """THE GATE (fails until the runtime rewrite lands): no host sync on the launching thread in a steady step."""
    m = point(model_name, name, runtime, GATE_BATCH, GATE_PROMPT)
    assert m["syncs_max_step"] == 0, (
        f"{name} (runtime={runtime}) on {model_name}, batch {GATE_BATCH}, prompt {GATE_PROMPT}: "
        f"{m['syncs_per_layer_step']:.2f} host syncs per layer per steady decode step ({m['syncs_per_step']:.3g} per "
        f"step, {m['layers']} layers): {where(m)}")


def test_gate_infinigen_ops_do_not_grow_with_the_prompt_or_the_batch():
    """THE GATE (fails until the runtime rewrite lands): InfiniGen's ops per layer-step at prompt 2048 are at most
    1.05x those at 512, and the same at batch 1 and 8 (tiny-llama-gqa); nor does it sync at any of them."""
    at = {size: point("tiny-llama-gqa", "infinigen", "auto", *size) for size in SIZES}
    ops = {size: m["ops_per_layer_step"] for size, m in at.items()}
    table = ", ".join(f"{b} x {p}: {v:.1f}" for (b, p), v in ops.items())
    problems = [f"batch {b}: {ops[(b, 2048)]:.1f} ops/layer-step at prompt 2048 > 1.05 x {ops[(b, 512)]:.1f} at 512"
                for b in (1, 8) if ops[(b, 2048)] > 1.05 * ops[(b, 512)]]
    problems += [f"prompt {p}: {ops[(1, p)]:.1f} ops/layer-step at batch 1 != {ops[(8, p)]:.1f} at batch 8"
                 for p in (512, 2048) if ops[(1, p)] != ops[(8, p)]]
    problems += [f"{b} x {p}: {m['syncs_per_layer_step']:.2f} host syncs per layer-step ({where(m)})"
                 for (b, p), m in at.items() if m["syncs_max_step"]]
    assert not problems, f"InfiniGen on tiny-llama-gqa (ops/layer-step {table}): " + " | ".join(problems)
