"""What a run computes, as a config: the part of a resolved run config that its results depend on.

The runner hashes it (with the data's identity) into a run's config hash; the report matches stored rows on it
against what each section's command composes today. It sits here, below both, so that the layer reading the rows
never imports the layer writing them. Only the standard library: it runs while a config is validated.
"""

from __future__ import annotations

# config keys that do not change what is computed: locations and bookkeeping (data folders enter a run's identity
# as the content of the data read from them, experiments/identity.py data_identity)
NON_SEMANTIC = ("force", "logger", "results_dir", "data_dir", "hydra", "progress", "debug")
# method options that do not change what is computed: a location, and how H2O's / TOVA's sim-mode row loop is
# dispatched on a CUDA device (`capture`: eagerly or as a captured graph, the same results)
NON_SEMANTIC_METHOD = ("calib_data_dir", "capture")
# method classes that moved (`_target_` now -> as stored rows were hashed with it): a moved class computes what it
# did, so a run hashes and matches with the path its rows were written with (tests/test_configs.py freezes each
# conf/method's hash)
MOVED_TARGETS = {"infinigen.method.infinigen.InfiniGen": "infinigen.infinigen_method.infinigen.InfiniGen"}
# method options added after rows were stored, with the value that means the behaviour from before they existed:
# at that value a run computes what a row without the key did, so the key is left out (the stored rows stay valid)
LATER_METHOD_OPTIONS = {"budget_tokens": None, "qk_norm": "rms", "budget_of": "prefix", "threshold_head": "own",
                        "current_token": "kept", "column_count": "round", "column_tokens": None, "column_calibration": None,
                        "heavy_hitters": "cache", "dense_layers": 0}
# the same for task options (the latency task's schedule of the performance model: infinigen/offload/paper.py)
LATER_TASK_OPTIONS = {"schedule": "overlapped", "paper": {}, "skip_windows": 0}
# task options that change how fast a task runs, never what it computes, hashed at the one value stored rows were
# written with: whatever it is set to, a run is the same config as theirs. lm_eval's batch_size: equal-length
# requests share a forward, never padded (tests/test_lm_eval.py: the same scores and stats at any batch size); its
# default went from 1 to auto (issue 63)
SPEED_TASK_OPTIONS = {"lm_eval": {"batch_size": 1}}

# lm_eval options only RULER tasks read (the QA files only its QA tasks): a run without one computes the same
# whatever they say
RULER_OPTIONS = ("max_seq_lengths", "haystack")
QA_OPTIONS = ("qa_data",)
# the RULER task names of lm-eval 0.4.13 (experiments/lm_eval_tasks/ruler.py generates them; tests/test_report.py
# checks these are its names)
RULER_QA_TASKS = ("ruler_qa_squad", "ruler_qa_hotpot")
RULER_TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe",
                    *RULER_QA_TASKS)


def semantic_method(method: dict) -> dict:
    """What a method config computes: without its locations, without a later option at its neutral value, and with a
    moved class named as before its move."""
    out = {k: v for k, v in method.items() if k not in NON_SEMANTIC_METHOD
           and not (k in LATER_METHOD_OPTIONS and v == LATER_METHOD_OPTIONS[k])}
    if out.get("_target_") in MOVED_TARGETS:
        out["_target_"] = MOVED_TARGETS[out["_target_"]]
    return out


def semantic_config(config: dict) -> dict:
    """What a run computes: a resolved config without locations, bookkeeping and options the run does not read."""
    out = {k: v for k, v in config.items() if k not in NON_SEMANTIC}
    out["method"] = semantic_method(out.get("method", {}))
    task = out.get("task")
    if isinstance(task, dict):
        speed = SPEED_TASK_OPTIONS.get(task.get("name"), {})
        task = out["task"] = {k: speed.get(k, v) for k, v in task.items()
                              if not (k in LATER_TASK_OPTIONS and v == LATER_TASK_OPTIONS[k])}
    if isinstance(task, dict) and task.get("name") == "lm_eval":
        names = [task["tasks"]] if isinstance(task.get("tasks"), str) else list(task.get("tasks") or [])
        unread = ((RULER_OPTIONS if not any(name in RULER_TASK_NAMES for name in names) else ())
                  + (QA_OPTIONS if not any(name in RULER_QA_TASKS for name in names) else ()))
        out["task"] = {k: v for k, v in task.items() if k not in unread}
    return out
