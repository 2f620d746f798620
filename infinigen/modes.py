"""Running a model under a KV method: sim-mode forward, decode-mode prefill + token steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinigen import adapter

# Logits per scoring block (rows x vocab): 32 MB in fp32 whatever the sequence length (170 rows of smollm2's
# 49,152-token vocab, 65 of Llama-3's 128,256). Scoring never holds more than one block (and its float64 copy).
LOGIT_BLOCK = 1 << 23


@torch.inference_mode()
def sim_hidden(model, method, input_ids: torch.Tensor, dense_rows: int = 0, attention_mask=None,
               attention: str = "fused") -> torch.Tensor:
    """One teacher-forced forward; rows >= dense_rows behave as decoded tokens. (b, t) -> final hidden states
    (b, t, hidden), the LM head's input: score them with `token_logprobs`.
    attention: "fused" (SDPA per row chunk) or "exact" (transformers' eager math per row chunk)."""
    with adapter.install(model, method, mode="sim", dense_rows=dense_rows, max_len=input_ids.shape[1],
                         attention=attention):
        return adapter.final_hidden(model, input_ids, attention_mask=attention_mask, use_cache=False)


@torch.inference_mode()
def sim_prefix(model, method, input_ids: torch.Tensor, dense_rows: int = 0, copies: int = 1,
               max_len: int = 0) -> tuple[torch.Tensor, object]:
    """`sim_hidden` of sequences' first rows (b, c), and their past: the cache, and what the method keeps beyond
    it (`Session.carry`), that `sim_resume` continues those sequences from, for a method whose sim mode resumes
    (`prefix_resumable`). copies: how many sequences each row begins, as many times as its rows' stats are recorded
    (what a forward of each whole sequence would record); max_len: the longest of those sequences."""
    if not method.prefix_resumable:
        raise ValueError(f"{type(method).__name__}'s sim mode does not resume after a prefix (prefix_resumable)")
    cache = adapter.prefix_cache()
    with method.stats.repeated(copies), adapter.install(model, method, mode="sim", dense_rows=dense_rows,
                                                        max_len=max_len or input_ids.shape[1]) as session:
        hidden = adapter.final_hidden(model, input_ids, cache=cache, use_cache=True)
    return hidden, (cache, session.carry)


@torch.inference_mode()
def sim_resume(model, method, past, index: torch.Tensor, input_ids: torch.Tensor, dense_rows: int = 0,
               max_len: int = 0) -> torch.Tensor:
    """The final hidden states (n, x, hidden) of rows that continue `sim_prefix`'s sequences `index` (n,) with
    input_ids (n, x): for a `prefix_resumable` method, those rows of one `sim_hidden` forward of the whole
    sequences (dense_rows and max_len counted over the whole sequence, as there)."""
    cache, carry = adapter.resume_cache(past[0], index), past[1]
    if dense_rows > cache.get_seq_length():
        raise ValueError(f"dense_rows={dense_rows} reaches past the prefix ({cache.get_seq_length()} tokens): rows "
                         "resumed after it are decoded rows")
    longest = max_len or cache.get_seq_length() + input_ids.shape[1]
    with adapter.install(model, method, mode="sim", dense_rows=dense_rows, max_len=longest) as session:
        session.carried = {layer: {name: x.index_select(0, index) if isinstance(x, torch.Tensor) else x
                                   for name, x in kept.items()} for layer, kept in carry.items()}
        return adapter.final_hidden(model, input_ids, cache=cache, use_cache=True)


@torch.inference_mode()
def sim_logits(model, method, input_ids: torch.Tensor, dense_rows: int = 0, attention_mask=None,
               attention: str = "fused") -> torch.Tensor:
    """`sim_hidden` through the LM head, (b, t) -> (b, t, vocab) fp32: whole distributions, for comparing two
    forwards at modest t. Scoring tokens goes through `token_logprobs`, which never forms these."""
    hidden = sim_hidden(model, method, input_ids, dense_rows, attention_mask, attention)
    return adapter.lm_head(model)(hidden).float()


@dataclass
class TokenScores:
    logprob: torch.Tensor  # float64, targets' shape: log p(target)
    greedy: torch.Tensor  # bool, targets' shape: the target is its row's argmax
    finite: bool  # every logit of every row was finite


@torch.inference_mode()
def token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> TokenScores:
    """Scores of targets (...) under the logits of hidden (..., hidden), LOGIT_BLOCK logits at a time: the LM head
    over a block of rows, then the target's logit and the block's log-sum-exp in float64. Memory: one block,
    whatever the number of rows (a whole sequence's (t, vocab) logits are never formed)."""
    head = adapter.lm_head(model)
    flat, want = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # (n, hidden), (n,)
    rows = max(1, LOGIT_BLOCK // head.weight.shape[0])
    logprob, greedy, finite = [], [], torch.ones((), dtype=torch.bool, device=hidden.device)
    for start in range(0, flat.shape[0], rows):
        logits = head(flat[start : start + rows])  # (r, vocab)
        target = want[start : start + rows, None]  # (r, 1)
        finite &= torch.isfinite(logits).all()
        greedy.append(logits.argmax(-1) == target[:, 0])
        logits = logits.double()  # a copy unless the model runs in float64: then the head's own output
        picked = logits.gather(-1, target)[:, 0]
        top = logits.amax(-1, keepdim=True)
        lse = logits.sub_(top).exp_().sum(-1).log_() + top[:, 0]
        logprob.append(picked - lse)
    empty = flat.new_empty(0, dtype=torch.float64)
    return TokenScores(logprob=torch.cat(logprob or [empty]).view(targets.shape),
                       greedy=torch.cat(greedy or [empty.bool()]).view(targets.shape), finite=bool(finite))


def new_cache(model, method):
    return adapter.new_cache([method.new_store(layer) for layer in adapter.attention_layers(model)])


def prefill(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    t = input_ids.shape[1]
    pos = torch.arange(t, device=input_ids.device)[None]
    # logits_to_keep=1: the next token needs the last row only, not the prompt's (t, vocab) logits
    return model(input_ids, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1).logits[:, -1].float()


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
