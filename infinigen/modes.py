"""Running a model under a KV method: sim-mode forward, decode-mode prefill + token steps."""

from __future__ import annotations

import torch

from infinigen import adapter


@torch.inference_mode()
def sim_logits(model, method, input_ids: torch.Tensor, dense_rows: int = 0, attention_mask=None,
               attention: str = "fused") -> torch.Tensor:
    """One teacher-forced forward; rows >= dense_rows behave as decoded tokens. (b, t) -> (b, t, vocab).
    attention: "fused" (SDPA per row chunk) or "exact" (transformers' eager math per row chunk)."""
    with adapter.install(model, method, mode="sim", dense_rows=dense_rows, max_len=input_ids.shape[1],
                         attention=attention):
        return model(input_ids, attention_mask=attention_mask, use_cache=False).logits.float()


def new_cache(model, method):
    return adapter.new_cache([method.new_store(layer) for layer in adapter.attention_layers(model)])


def prefill(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    t = input_ids.shape[1]
    pos = torch.arange(t, device=input_ids.device)[None]
    return model(input_ids, cache=cache, position_ids=pos, use_cache=True).logits[:, -1].float()


def decode_step(model, token: torch.Tensor, cache, position: int) -> torch.Tensor:
    """token (b, 1) at `position` -> next-token logits (b, vocab)."""
    pos = torch.full((token.shape[0], 1), position, device=token.device)
    return model(token, cache=cache, position_ids=pos, use_cache=True).logits[:, -1].float()


@torch.inference_mode()
def decode_logits(model, method, input_ids: torch.Tensor, dense_rows: int, progress: bool = False,
                  attention: str = "fused") -> torch.Tensor:
    """Teacher-forced decode mode: prefill input_ids[:, :dense_rows], then feed the rest one token per step.
    Returns logits for rows dense_rows-1 .. t-2 (the predictions of tokens dense_rows .. t-1), (b, t-dense_rows, V).
    The last token is fed too (its prediction is dropped) so both modes process, and count stats for, every row.
    attention: the prefill's kernel (decode steps always use the method's own `decode_attention`).
    """
    from tqdm import tqdm

    cache = new_cache(model, method)
    t = input_ids.shape[1]
    with adapter.install(model, method, mode="decode", dense_rows=dense_rows, cache=cache, max_len=t,
                         attention=attention):
        out = [prefill(model, input_ids[:, :dense_rows], cache)]
        for pos in tqdm(range(dense_rows, t), disable=not progress, desc="decode", leave=False):
            out.append(decode_step(model, input_ids[:, pos : pos + 1], cache, pos))
    method.last_cache = cache
    return torch.stack(out[:-1], dim=1)


def cache_bytes(model, method, input_ids: torch.Tensor) -> tuple[int, int]:
    """(bytes the method's decode-mode cache holds, bytes a dense cache in the model's dtype holds) after a dense
    prefill of input_ids[:, :-1] and one decode step: what the method keeps at that sequence length."""
    decode_logits(model, method, input_ids, dense_rows=input_ids.shape[1] - 1)
    held = method.store_bytes(list(method.last_cache.layers))
    method.last_cache = None
    entry = torch.finfo(model.dtype).bits // 8
    dense = sum(2 * input_ids.numel() * layer.num_kv_heads * layer.head_dim * entry for layer in adapter.attention_layers(model))
    return held, dense


@torch.inference_mode()
def greedy_generate(model, method, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = new_cache(model, method)
    t = input_ids.shape[1]
    with adapter.install(model, method, mode="decode", dense_rows=t, cache=cache, max_len=t + new_tokens):
        nxt = prefill(model, input_ids, cache).argmax(-1, keepdim=True)
        out = [nxt]
        for pos in range(t, t + new_tokens - 1):
            nxt = decode_step(model, nxt, cache, pos).argmax(-1, keepdim=True)
            out.append(nxt)
    return torch.cat([input_ids, *out], dim=1)
