"""`KVMethodLM`: lm-eval's HF causal LM with every forward computed under a KV method (see experiments/lm_eval.py).

A module of its own because importing lm-eval costs seconds: experiments/lm_eval.py validates a config without it.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from experiments.lm_eval_protocols import AUTO, check_protocol, dense_rows_of, requests_per_forward
from infinigen import adapter, modes

# what lm-eval's HFLM is told when task.batch_size=auto: how many rolling windows / generation prompts it hands over
# at once (its own `max_batch_size` default); each forward is then sized here, per input length
HANDED_OVER = 64


# ----------------------------------------------------------------------------------------------- the LM


@register_model("kv_method")
class KVMethodLM(HFLM):
    """lm-eval's HF causal LM around an already loaded model + tokenizer, every forward through `method`."""

    def __init__(
        self,
        model,
        tokenizer,
        method,
        protocol: str = "paper",
        dense_rows: int = 0,
        batch_size: int | str = AUTO,
        max_length: int | None = None,
    ):
        check_protocol(protocol, "protocol")
        if tokenizer is None:
            if model.config.vocab_size < 257:
                raise ValueError(f"byte_tokenizer needs a vocab of >= 257 ids, model has {model.config.vocab_size}")
            tokenizer = adapter.byte_tokenizer()
        handed_over = HANDED_OVER if batch_size == AUTO else int(batch_size)
        super().__init__(
            pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=handed_over, max_length=max_length
        )
        self.batch_option = batch_size if batch_size == AUTO else int(batch_size)  # task.batch_size, as rows record it
        self.method = method
        self.protocol = protocol
        self.dense_rows = dense_rows
        self.counts = {"requests": 0, "forwards": 0, "rows": 0, "generated": 0}

    def reset_counts(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)

    def model_input(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[int, ...]:
        """The model input HFLM builds for a request: (context + continuation)[-(max_length + 1):][:-1]."""
        if not context_enc or not continuation_enc or len(continuation_enc) > self.max_length:
            raise ValueError(f"a request needs a context and a continuation of 1..{self.max_length} tokens, got "
                             f"{len(context_enc)} and {len(continuation_enc)}")
        return tuple((context_enc + continuation_enc)[-(self.max_length + 1) :][:-1])

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(log-likelihood, is_greedy) of each (strings, context ids, continuation ids) request, as HFLM scores it:
        the continuation's log-probs from the input rows that predict its tokens. Unlike HFLM, which takes the
        log-softmax of the whole (batch, t, vocab) logits, only those rows go through the LM head, in blocks
        (`modes.token_logprobs`): memory stays linear in t. Requests are grouped by input length (and, for serving,
        context length), so every batch is pad-free: neither a method that reads the sequence length
        (`session.max_len`) nor its stats see pad rows, and the serving protocol's dense_rows is one int. Requests
        with the same input share one forward (lm-eval's one-token-continuation logits cache, generalised)."""
        self.counts["requests"] += len(requests)
        groups: dict[tuple[int, int], dict[tuple[int, ...], list[int]]] = {}  # (rows, dense_rows) -> input -> requests
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            inp = self.model_input(context_enc, continuation_enc)
            dense = dense_rows_of(self.protocol, len(inp), len(continuation_enc), self.dense_rows)
            groups.setdefault((len(inp), dense), {}).setdefault(inp, []).append(i)
        out: list[Any] = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc=f"loglikelihood ({self.protocol})") as bar:
            for (rows, dense), inputs in groups.items():
                batches = list(inputs.items())
                size = requests_per_forward(self.batch_option, rows)
                for b in range(0, len(batches), size):
                    batch = batches[b : b + size]
                    inps = torch.tensor([inp for inp, _ in batch], device=self.device)  # (b, t)
                    hidden = self._hidden_call(inps, dense)  # (b, t, hidden)
                    where = f"forward {self.counts['forwards']} (batch {tuple(inps.shape)})"
                    scored = [(i, row) for row, (_, index) in zip(hidden, batch, strict=True) for i in index]
                    answers = self._score([requests[i] for i, _ in scored], [row for _, row in scored], where)
                    for (i, _), answer in zip(scored, answers, strict=True):
                        out[i] = answer
                    bar.update(len(scored))
        return out

    def _score(self, requests, hiddens: list[torch.Tensor], where: str) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each request's continuation from its input's final hidden states (t, hidden).
        A forward's requests go through the LM head together: its weights (vocab x hidden, 113 MB for SmolLM2) are
        read once per block of rows instead of once per request."""
        conts = [torch.tensor(continuation_enc, device=self.device) for _, _, continuation_enc in requests]
        rows = torch.cat([hidden[-cont.numel() :] for hidden, cont in zip(hiddens, conts, strict=True)])
        scores = modes.token_logprobs(self.model, rows, torch.cat(conts))
        if not scores.finite:  # lm-eval would turn NaN log-likelihoods into a plausible accuracy
            raise FloatingPointError(
                f"lm_eval: non-finite logits in {where}; no row written (check model.arch, model.dtype, the method)"
            )
        sizes = [cont.numel() for cont in conts]
        answers = []
        for (request_str, _, _), logprob, greedy in zip(requests, scores.logprob.split(sizes),
                                                        scores.greedy.split(sizes), strict=True):
            answer = (float(logprob.sum()), bool(greedy.all()))
            if request_str is not None:  # loglikelihood_rolling's windows have none: it caches per document itself
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
            answers.append(answer)
        return answers

    def _hidden_call(self, inps: torch.Tensor, dense_rows: int) -> torch.Tensor:
        """inps (b, t), pad-free -> final hidden states (b, t, hidden) of one sim-mode forward through the method."""
        self.counts["forwards"] += 1
        self.counts["rows"] += inps.numel()
        return modes.sim_hidden(self.model, self.method, inps, dense_rows=dense_rows)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        # HFLM's would run the plain model, bypassing the method; every score here goes through `_hidden_call`
        # (lm-eval's own batch_size="auto" would probe it: KVMethodLM sizes its forwards itself, requests_per_forward)
        raise NotImplementedError("KVMethodLM scores through _loglikelihood_tokens")

    # ------------------------------------------------------------------ generation (decode mode)
    def _stop_ids(self) -> set[int]:
        """Token ids that end a generation, as `model.generate` would (generation config) plus the tokenizer's eos."""
        ids = {self.tokenizer.eos_token_id}
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
        return {i for i in ids if i is not None}

    @torch.inference_mode()
    def greedy(self, ids: torch.Tensor, new_tokens: int, stop: list[str]) -> list[int]:
        """Greedy continuation of ids (1, t) through the method in decode mode: dense prefill, then one token per
        step; ends after new_tokens, at an eos id, or once the decoded text contains a stop string."""
        stop_ids, stop = self._stop_ids(), [s for s in stop if s]
        cache = modes.new_cache(self.model, self.method)
        t = ids.shape[1]
        out: list[int] = []
        with adapter.install(self.model, self.method, mode="decode", dense_rows=t, cache=cache, max_len=t + new_tokens):
            logits = modes.prefill(self.model, ids, cache)
            for pos in range(t, t + new_tokens):
                out.append(int(logits.argmax(-1)))
                if out[-1] in stop_ids or len(out) == new_tokens:
                    break
                if stop and any(s in self.tok_decode(out) for s in stop):
                    break
                logits = modes.decode_step(self.model, torch.tensor([[out[-1]]], device=ids.device), cache, pos)
        self.counts["generated"] += len(out)
        return out

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Replaces HFLM's `model.generate` (which would bypass the method). context (b, t) is left-padded;
        returns (b, t + new) with the generated ids after each row's padded context, right-padded."""
        if generation_kwargs.get("do_sample"):
            raise NotImplementedError("KVMethodLM generates greedily only (do_sample=false)")
        mask = generation_kwargs.pop("attention_mask", None)
        new_tokens = max_length - context.shape[1]
        rows = []
        for i in range(context.shape[0]):
            ids = context[i] if mask is None else context[i][mask[i].bool()]
            rows.append(self.greedy(ids[None], new_tokens, stop))
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        generated = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=context.device)
        return torch.cat([context, generated], dim=1)

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "kv_method": type(self.method).__name__,
            "protocol": self.protocol,
        }
