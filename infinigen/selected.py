"""InfiniGen's setting per model family: what `method=infinigen` gives on a model.

conf/method/infinigen.yaml reads its four speculation knobs through the `infinigen_setting` resolver, which looks
up the run's `model.arch.model_type` here: the setting selected for that family on held-out data (a committed sweep,
`python run.py -m +experiment=select_infinigen`, on WikiText-2 windows no verdict scores), by the rule written in
analysis/report/selection.py; docs/results.md shows the sweep and checks this table against the rule's pick. A
family the sweep has not covered (OPT, where the paper ran) keeps the paper's values. An explicit override
(`method.alpha=4`) or a preset's point pins a knob whatever the family.

Only omegaconf and the standard library: it runs while a config is composed.
"""

from __future__ import annotations

from omegaconf import OmegaConf

KEYS = ("skip_layers", "alpha", "partial_ratio", "speculate_from")
PAPER = {"skip_layers": 1, "alpha": 4.0, "partial_ratio": 0.2, "speculate_from": "previous"}  # the OPT artifact's
LLAMA = {"skip_layers": 2, "alpha": 8.0, "partial_ratio": 0.5, "speculate_from": "previous"}
# Gemma-3-270M: with 2 of its 18 layers dense no budget swept reaches kv_fraction 15%, and at 20% one dense layer
# and alpha 4 lose least: the paper's values
GEMMA3 = dict(PAPER)
# model_type -> setting; SmolLM2 stands for the Llama family (Llama, Mistral, Qwen2 share its block), Gemma-3-270M
# for Gemma 3
SELECTED = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma3_text": GEMMA3}
# the model each family's setting was selected on
SELECTED_ON = {"llama": "smollm2-135m", "gemma3_text": "gemma3-270m"}


def setting(model_type: str | None) -> dict:
    """The InfiniGen setting a model of `model_type` gets by default."""
    return SELECTED.get(model_type, PAPER)


def _resolve(key: str, *, _root_):
    if key not in KEYS:
        raise ValueError(f"infinigen_setting: unknown key {key!r}; one of {KEYS}")
    return setting(OmegaConf.select(_root_, "model.arch.model_type", default=None))[key]


OmegaConf.register_new_resolver("infinigen_setting", _resolve, replace=True)

# conf/method/infinigen_reference.yaml: what differs between the artifact's two model paths (docs/methods.md). Its
# OPT code (accuracy/src/modeling_opt_ours.py) thresholds each head by its own best and its scripts run alpha 4
# (perplexity/table2.sh); its Llama code (modeling_llama_ours.py) thresholds every head by the first head's best,
# with alpha 5 (table2.sh; figure12.sh runs 5.2). Other families take the Llama path's values.
REFERENCE = {"opt": {"alpha": 4.0, "threshold_head": "own"}}
REFERENCE_LLAMA = {"alpha": 5.0, "threshold_head": "first"}


def _reference(key: str, *, _root_):
    model_type = OmegaConf.select(_root_, "model.arch.model_type", default=None)
    setting_ = REFERENCE.get(model_type, REFERENCE_LLAMA)
    if key not in setting_:
        raise ValueError(f"infinigen_reference: unknown key {key!r}; one of {tuple(setting_)}")
    return setting_[key]


OmegaConf.register_new_resolver("infinigen_reference", _reference, replace=True)
