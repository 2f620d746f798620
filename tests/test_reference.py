"""The reference settings (method=infinigen_reference, method=h2o_reference) against the authors' own code.

tests/data/reference/ holds what the InfiniGen artifact (github.com/snu-comparch/InfiniGen, accuracy/) computed when
run on CPU, outside this repository (docs/reference.md: how, with which changes, how to regenerate): per window the
summed NLL, per layer and window the kept entries, and on window 0 the kept set of every (layer, head, row) of a few
layers. Both sides run in float64 on the same token ids, so that what is compared is the algorithm: in float32 a
near-tie decided differently early in a window changes the hidden states every later layer sees (measured at 2,048
tokens: docs/reference.md). Each case is held to what the issue asked: perplexity within 0.1%, kept entries per
layer within 1%, kept sets identical on at least 99.9% of rows (the rows that differ are counted in the message).
"""

import json
import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from conftest import DATA_DIR, ROOT, load_model, method_from_conf, model_cfg
from infinigen import adapter
from infinigen.corpora import corpus_text
from infinigen.modes import sim_hidden, token_logprobs
from infinigen.adapter.multihead import repeat_kv_heads

DATA = ROOT / "tests" / "data" / "reference"
PPL_TOL, KEPT_TOL, ROWS_AGREE = 1e-3, 1e-2, 0.999
FILES = {"smollm2-135m": "smollm2_mha_256", "tiny-opt": "tiny_opt_256"}
# the same models and windows with the artifact's own partial-weight prompt (issue 72): its columns calibrated on
# setup/gen_partial_weight.py's six sentences (the data folder's infinigen_artifact/partial_weight_prompt.txt), the
# skew still on PG-19; the harness runs it as method.column_calibration=infinigen_prompt method.column_tokens=null
PROMPT_FILES = {"smollm2-135m": "smollm2_mha_256_prompt", "tiny-opt": "tiny_opt_256_prompt"}
# windows checked here of the ones recorded (the real model's second is the check script's: docs/reference.md)
WINDOWS = {"smollm2-135m": 1, "tiny-opt": 2}

pytestmark = pytest.mark.slow  # the real model in float64 (~1 min)


@lru_cache(maxsize=None)
def golden(model: str, files: tuple = tuple(FILES.items())) -> dict:
    return json.loads((DATA / f"{dict(files)[model]}.json").read_text())


@lru_cache(maxsize=None)
def golden_masks(model: str):
    return np.load(DATA / f"{FILES[model]}_masks.npz")


@lru_cache(maxsize=None)
def model_and_ids(model: str):
    """The model in float64 as the artifact ran it (SmolLM2 with one KV head per query head) and the token ids."""
    if model == "smollm2-135m":
        loaded, tokenizer = load_model(model, "float64")  # its float32 checkpoint, read in float64
        loaded = repeat_kv_heads(loaded)
    else:  # the random weights drawn in float32 (as saved for the artifact), then widened; a copy of its own: the
        loaded, tokenizer = adapter.load(model_cfg(model))  # skew folds into OPT's weights
        loaded = loaded.double()
    adapter.remember_tokenizer(loaded, tokenizer)
    ids = adapter.encode(tokenizer, corpus_text("wikitext2", DATA_DIR), loaded.config.vocab_size)
    return loaded, ids


def reference_method(model: str, run: dict):
    overrides = dict(run.get("overrides", {}))
    if run["method"] == "infinigen_reference":
        overrides["cache_dir"] = None
        if model == "tiny-opt":  # its 1,024 positions: the artifact calibrated on 1,024 tokens, as the harness does
            overrides.update(threshold_head="own", calib_tokens=1024)
    return method_from_conf(run["method"], **overrides)


def run_harness(model: str, run: dict):
    """Per window the summed NLL, per layer the kept entries of each window, and window 0's kept sets."""
    loaded, ids = model_and_ids(model)
    method = reference_method(model, run)
    masks = {}
    record = method.record_sim

    def spy(session, layer, keep, allowed, rows, start=None, kept=None):
        if layer.index in run.get("mask_layers", ()) and not nll:
            chosen = keep if kept is None else keep & (kept > 0)[..., None]  # a row that kept nothing attends all
            masks.setdefault(layer.index, []).append(chosen[0])
        return record(session, layer, keep, allowed, rows, start, kept)

    method.record_sim = spy
    nll, kept = [], []
    t = run["seq_len"]
    for j in range(WINDOWS[model]):
        window = ids[j * t : (j + 1) * t][None]
        method.reset_stats()
        hidden = sim_hidden(loaded, method, window, attention="exact")  # the artifact's eager math
        nll.append(float(-token_logprobs(loaded, hidden[0, :-1], window[0, 1:]).logprob.sum()))
        kept.append(method.stats.summary()["per_layer"].get("kept", {}))
    whole = {layer: torch.cat([torch.nn.functional.pad(m, (0, t - m.shape[-1])) for m in parts], dim=1)
             for layer, parts in masks.items()}  # (h_kv, t, t)
    return nll, kept, whole


CASES = [pytest.param(model, name, id=f"{model}-{name.split('/')[1]}") for model in FILES
         for name in sorted(golden(model)["runs"])]


PROMPT_CASES = [pytest.param(model, name, id=f"{model}-{name.split('/')[1]}-prompt") for model in PROMPT_FILES
                for name in sorted(golden(model, tuple(PROMPT_FILES.items()))["runs"])]


@pytest.mark.parametrize("model,name", PROMPT_CASES)
def test_reference_setting_on_the_artifacts_own_prompt_computes_what_the_artifact_computed(model, name):
    """The artifact on its own inputs: the partial columns from its six-sentence prompt (tokenised whole, as
    gen_partial_weight.py does), the skew from PG-19; the harness names the prompt as its column_calibration."""
    run = golden(model, tuple(PROMPT_FILES.items()))["runs"][name]
    assert run["overrides"]["column_calibration"] == "infinigen_prompt"
    check_against_the_artifact(model, name, run)


@pytest.mark.parametrize("model,name", CASES)
def test_reference_setting_computes_what_the_artifact_computed(model, name):
    check_against_the_artifact(model, name, golden(model)["runs"][name])


def check_against_the_artifact(model: str, name: str, run: dict):
    nll, kept, masks = run_harness(model, run)
    scored = len(nll) * (run["seq_len"] - 1)
    ppl, ppl_ref = math.exp(sum(nll) / scored), math.exp(sum(run["window_nll"][: len(nll)]) / scored)
    assert abs(ppl / ppl_ref - 1) <= PPL_TOL, f"perplexity {ppl:.5f} vs the artifact's {ppl_ref:.5f}"
    for layer, per_window in run["kept"].items():
        for j, ref in enumerate(per_window[: len(nll)]):
            mine = kept[j].get(int(layer), 0.0)
            assert abs(mine - ref) <= KEPT_TOL * ref, f"layer {layer} window {j}: {mine:.0f} kept vs {ref}"
    if not run.get("mask_layers"):
        return
    differ = rows = 0
    t = run["seq_len"]
    below = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for layer in run["mask_layers"]:
        packed = golden_masks(model)[f"{name}/{layer}"]
        heads = masks[layer].shape[0]
        bits = np.unpackbits(packed)[: heads * int(below.sum())].astype(bool)
        ref = torch.zeros(heads, t, t, dtype=torch.bool)
        ref[:, below] = torch.from_numpy(bits).view(heads, -1)
        same = (masks[layer] == ref).all(-1)  # (h, t)
        differ, rows = differ + int((~same).sum()), rows + same.numel()
    assert (rows - differ) / rows >= ROWS_AGREE, f"{differ} of {rows} (layer, head, row) kept sets differ"
