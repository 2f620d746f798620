"""`KVMethodLM`: lm-eval's HF causal LM with every forward computed under a KV method (see experiments/lm_eval.py).

A module of its own because importing lm-eval costs seconds: experiments/lm_eval.py validates a config without it.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from experiments.lm_eval_protocols import AUTO, check_protocol, dense_rows_of, requests_per_forward, shared_prefixes
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
        (`modes.token_logprobs`): memory stays linear in t. Every batch is pad-free: neither a method that reads the
        sequence length (`session.max_len`) nor its stats see pad rows, and the serving protocol's dense_rows is one
        int. Requests with the same input share one forward (lm-eval's one-token-continuation logits cache,
        generalised); under a method whose sim mode resumes after a prefix (`prefix_resumable`), inputs that begin
        alike (a doc's choices after their context and few-shot examples) share one forward of that prefix
        (`_score_shared`); the others are scored whole (`_score_whole`)."""
        self.counts["requests"] += len(requests)
        inputs: dict[tuple[tuple[int, ...], int], list[int]] = {}  # (input, dense_rows) -> its requests
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            inp = self.model_input(context_enc, continuation_enc)
            dense = dense_rows_of(self.protocol, len(inp), len(continuation_enc), self.dense_rows)
            inputs.setdefault((inp, dense), []).append(i)
        groups = self.shared_groups(list(inputs)) if self.method.prefix_resumable else []
        grouped = {key for _, _, members in groups for key in members}
        out: list[Any] = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc=f"loglikelihood ({self.protocol})") as bar:
            self._score_whole(requests, {key: index for key, index in inputs.items() if key not in grouped}, out, bar)
            self._score_shared(requests, [(p, dense, {key: inputs[key] for key in members})
                                          for p, dense, members in groups], out, bar)
        return out

    @staticmethod
    def shared_groups(keys: list[tuple[tuple[int, ...], int]]) -> list[tuple[int, int, list]]:
        """(prefix length, dense_rows, (input, dense_rows) keys) of the inputs that share a prefix (`shared_prefixes`)
        holding their dense rows: inputs of one dense_rows (serving: one context length), whose rows after the
        prefix are all decoded rows, so the prefix's rows are what a forward of each whole input computes."""
        groups = []
        for dense in sorted({d for _, d in keys}):
            same = [key for key in keys if key[1] == dense]
            groups += [(p, dense, [same[k] for k in members]) for p, members in shared_prefixes([i for i, _ in same])
                       if p >= dense]
        return groups

    def _score_whole(self, requests, inputs: dict, out: list, bar) -> None:
        """Scores the requests of `inputs` ((input, dense_rows) -> requests), one forward of each input."""
        groups: dict[tuple[int, int], list] = {}  # (rows, dense_rows) -> [(input, requests)]
        for (inp, dense), index in inputs.items():
            groups.setdefault((len(inp), dense), []).append((inp, index))
        for (rows, dense), batches in groups.items():
            size = requests_per_forward(self.batch_option, rows)
            for b in range(0, len(batches), size):
                batch = batches[b : b + size]
                inps = torch.tensor([inp for inp, _ in batch], device=self.device)  # (b, t)
                hidden = self._hidden_call(inps, dense)  # (b, t, hidden)
                where = f"forward {self.counts['forwards']} (batch {tuple(inps.shape)})"
                self._answer(requests, [(i, row) for row, (_, index) in zip(hidden, batch, strict=True)
                                        for i in index], out, where, bar)

    def _score_shared(self, requests, groups: list[tuple[int, int, dict]], out: list, bar) -> None:
        """Scores the requests of groups of inputs that share a prefix ((prefix length, dense_rows, (input,
        dense_rows) -> requests) each): one forward of each group's prefix (prefixes of one length and as many
        inputs in a batch, their rows' stats recorded once per input), then each input's tail resumed from its
        prefix's past, tails of one length in a batch. An input's rows are its prefix's and its tail's: those of one
        forward of it whole."""
        batches: dict[tuple[int, int, int], list[dict]] = {}  # (prefix rows, inputs, dense_rows) -> groups
        for p, dense, members in groups:
            batches.setdefault((p, len(members), dense), []).append(members)
        for (p, copies, dense), same in batches.items():
            size = requests_per_forward(self.batch_option, p)
            for b in range(0, len(same), size):
                batch = same[b : b + size]
                longest = max(len(inp) for members in batch for inp, _ in members)
                inps = torch.tensor([next(iter(members))[0][:p] for members in batch], device=self.device)  # (b, p)
                self._count_forward(inps)
                prefix, past = modes.sim_prefix(self.model, self.method, inps, dense, copies=copies, max_len=longest)
                tails: dict[int, list] = {}  # tail rows -> [(batch row, input, requests)]
                for j, members in enumerate(batch):
                    for (inp, _), index in members.items():
                        tails.setdefault(len(inp) - p, []).append((j, inp, index))
                for x, items in tails.items():
                    step = requests_per_forward(self.batch_option, p + x)
                    for k in range(0, len(items), step):
                        part = items[k : k + step]
                        rows = (self._resumed_rows(past, part, p, dense, longest) if x else
                                [prefix[j, :0] for j, _, _ in part])
                        where = f"forward {self.counts['forwards']} ({len(part)} tails after {p} shared tokens)"
                        self._answer(requests, [(i, torch.cat([prefix[j], tail]))
                                                for (j, _, index), tail in zip(part, rows, strict=True)
                                                for i in index], out, where, bar)

    def _resumed_rows(self, past, part: list, p: int, dense: int, longest: int) -> list[torch.Tensor]:
        """The final hidden states (x, hidden) of each input's rows after its first p (`part`: (its prefix's batch
        row, input, requests), inputs of one length p + x), resumed from its prefix's past."""
        index = torch.tensor([j for j, _, _ in part], device=self.device)
        inps = torch.tensor([inp[p:] for _, inp, _ in part], device=self.device)  # (n, x)
        self._count_forward(inps)
        return list(modes.sim_resume(self.model, self.method, past, index, inps, dense, max_len=longest))

    def _answer(self, requests, scored: list[tuple[int, torch.Tensor]], out: list, where: str, bar) -> None:
        """Scores (request, its input's final hidden states) pairs into out."""
        answers = self._score([requests[i] for i, _ in scored], [row for _, row in scored], where)
        for (i, _), answer in zip(scored, answers, strict=True):
            out[i] = answer
        bar.update(len(scored))

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
        self._count_forward(inps)
        return modes.sim_hidden(self.model, self.method, inps, dense_rows=dense_rows)

    def _count_forward(self, inps: torch.Tensor) -> None:
        self.counts["forwards"] += 1
        self.counts["rows"] += inps.numel()

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
