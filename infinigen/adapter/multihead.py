"""A grouped-query model as the same model with one KV head per query head (multi-head attention).

Each KV head's rows of k_proj and v_proj (and their biases) are repeated for the g query heads that share it, so
every query head attends exactly the keys and values it attended before: the logits are the GQA model's (up to the
order of float sums), and the KV cache is g times larger. It is how a GQA checkpoint meets code written for MHA
only (`model.multihead=true`; the command `python -m infinigen.multihead` writes such a checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def repeat_kv_heads(model) -> torch.nn.Module:
    """A copy of `model` (a transformers causal LM) whose every attention layer has as many KV heads as query
    heads; the model itself is unchanged. A model that already has one KV head per query head is returned as is."""
    from transformers import AutoModelForCausalLM

    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # OPT's config has no such key: MHA
    if kv_heads == heads:
        return model
    groups = heads // kv_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            per_head = tensor.view(kv_heads, head_dim, *tensor.shape[1:])  # (h_kv, d, ...)
            tensor = per_head.repeat_interleave(groups, dim=0).reshape(heads * head_dim, *tensor.shape[1:])
        state[name] = tensor
    new_config = type(model.config).from_dict(model.config.to_dict())
    new_config.get_text_config().num_key_value_heads = heads
    with torch.device(next(model.parameters()).device):
        copy = AutoModelForCausalLM.from_config(new_config, dtype=next(model.parameters()).dtype)
    copy.load_state_dict(state)
    return copy.eval().requires_grad_(False)


def save(model, tokenizer, out: Path, for_transformers_4: bool = False) -> None:
    """The model and tokenizer as a checkpoint folder (`model.local_path`). for_transformers_4: also what
    transformers 4.3x and its tokenizers (< 0.19) read where 5.x writes it otherwise (a top-level `rope_theta`, the
    tokenizer class of a tokenizer.json-only tokenizer, BPE merges as "a b" strings rather than pairs), so reference
    code pinned to 4.3x loads the same weights and gives the same ids."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if not for_transformers_4:
        return
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")
    vocab_path = out / "tokenizer.json"
    if vocab_path.is_file():
        vocab = json.loads(vocab_path.read_text())
        merges = vocab.get("model", {}).get("merges") or []
        if merges and not isinstance(merges[0], str):
            if any(" " in part for pair in merges for part in pair):
                raise ValueError("a BPE merge holds a space: it has no 'a b' string form for tokenizers < 0.19")
            vocab["model"]["merges"] = [" ".join(pair) for pair in merges]
            vocab_path.write_text(json.dumps(vocab, ensure_ascii=False))
