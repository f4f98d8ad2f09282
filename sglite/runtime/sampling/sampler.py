"""The batched sampler: penalties, min_new_tokens, logprobs, then the draw (`draw.py`).

One call handles the whole running batch. Per-row parameters become [B] tensors, rows that need no
work of a kind skip it entirely, and an all-greedy batch is a single max over the vocabulary.

Order of operations (as in SGLang):
1. penalties: repetition on prompt + output tokens, then frequency/presence on output tokens;
2. min_new_tokens: EOS and `stop_token_ids` get -inf until the request has that many tokens;
3. the reported logprob is `log_softmax` of these logits, i.e. after penalties and masking but
   BEFORE temperature/top-k/top-p/min-p. The filters are a decoding strategy, not the model's
   belief, and a truncated distribution would report log(0) for perfectly plausible tokens; for a
   request without penalties this equals log_softmax of the raw model logits, which is what
   `select` and the OpenAI `logprobs` field expect;
4. temperature, then top-k, top-p and min-p on the tempered distribution (top-p measured on the
   full tempered distribution, not renormalized after top-k; min-p relative to its top token);
5. the draw: inverse-CDF sampling with one uniform number per row (`draw.py`).

Seeding: a seeded row draws its uniform from its own CPU generator (the same sequence on any
device). Unseeded rows are sampled together, with uniforms from torch's default CPU generator (so
`torch.manual_seed` reproduces them in tests). Each seeded row is sampled on its own, so its
arithmetic is bit-for-bit the same whatever else is in the batch (batched reductions may split a
row differently, and rounding could flip a draw that lands near a boundary) - a seeded request
gets the same tokens for the same logits in any batch.

A row with a NaN logit or no finite one (a numerically broken model output) cannot be sampled;
it is reported in `SampleResult.invalid_rows` (its token is meaningless) so the caller can fail
that request alone instead of drawing from garbage or crashing the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglite.runtime.model import kernels
from sglite.runtime.sampling.draw import draw_tokens, put_rows, take_rows
from sglite.runtime.sampling.request_state import SamplingInfo, TokenTable


@dataclass
class SampleResult:
    """What one `Sampler.sample` call chose, row by row."""

    next_token_ids: list[int]
    # log_softmax of the penalized, masked logits before temperature/filters (module docstring);
    # NaN for rows whose logprobs were not requested.
    logprobs: list[float]
    # (logprob, token_id) best first, for rows with top_logprobs_num > 0, else None.
    top_logprobs: list[list[tuple[float, int]] | None]
    # Rows whose logits had a NaN or no finite value; their token and logprobs are meaningless.
    invalid_rows: list[int] = field(default_factory=list)


class Sampler:
    """Chooses the next token of every row of a batch of logits (see the module docstring)."""

    def __init__(
        self, vocab_size: int, device: torch.device | str = "cpu", num_candidates: int = 64
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.num_candidates = num_candidates

    # ------------------------------------------------------------------ public API
    def sample(
        self,
        logits: torch.Tensor,
        infos: list[SamplingInfo],
        eos_token_ids: list[int],
        top_logprobs_nums: list[int] | None = None,
        return_logprobs: list[bool] | None = None,
    ) -> SampleResult:
        """Sample one token per row of `logits` [B, V]; `logits` itself is left untouched.

        `return_logprobs` (default: every row) lets a caller skip the log_softmax for rows that
        never report logprobs; rows with `top_logprobs_nums[i] > 0` always get them.
        """
        batch = logits.shape[0]
        if batch == 0:
            return SampleResult([], [], [])
        if len(infos) != batch:
            raise ValueError(f"{batch} rows of logits but {len(infos)} sampling infos")
        top_nums = top_logprobs_nums or [0] * batch
        x = logits if logits.dtype == torch.float32 else logits.float()
        x = self._apply_penalties(x, logits, infos)
        x = self._mask_min_new_tokens(x, logits, infos, eos_token_ids)
        best, best_index = _row_max(x)
        x, invalid = self._neutralize_invalid_rows(x, logits, best)
        tokens = self._choose(x, infos, best_index)
        logprobs, tops = self._report_logprobs(x, tokens, top_nums, return_logprobs)
        return SampleResult(tokens.tolist(), logprobs, tops, invalid)

    @staticmethod
    def _neutralize_invalid_rows(
        x: torch.Tensor, original: torch.Tensor, best: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows with a NaN or without a finite logit become all-zero (so every path below stays
        well-defined) and are returned by index. `best` is each row's max, NaN where the row
        has one: one pass finds both."""
        bad = ~torch.isfinite(best)
        if not bool(bad.any()):
            return x, []
        if x is original:
            x = x.clone()
        rows = bad.nonzero().flatten()
        x[rows] = 0.0
        return x, rows.tolist()

    def logprobs_of(
        self, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
    ) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
        """log_softmax(logits)[i, token_ids[i]] per row, and the `top_k` best when top_k > 0.

        Used for prompt-token logprobs: row i holds the logits predicting token_ids[i].
        """
        if logits.shape[0] == 0:
            return [], ([] if top_k > 0 else None)
        lp = torch.log_softmax(logits.float(), dim=-1)
        ids = token_ids.to(device=lp.device, dtype=torch.long).view(-1, 1)
        values = lp.gather(1, ids).squeeze(1).tolist()
        if top_k <= 0:
            return values, None
        tv, ti = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        rows = zip(tv.tolist(), ti.tolist(), strict=True)
        tops = [list(zip(vs, ts, strict=True)) for vs, ts in rows]
        return values, tops

    # ------------------------------------------------------------------ penalties & masking
    def _apply_penalties(
        self, x: torch.Tensor, original: torch.Tensor, infos: list[SamplingInfo]
    ) -> torch.Tensor:
        rep_rows = [i for i, info in enumerate(infos) if info.uses_repetition_penalty]
        add_rows = [i for i, info in enumerate(infos) if info.uses_additive_penalties]
        if not rep_rows and not add_rows:
            return x
        if x is original:
            x = x.clone()
        if rep_rows:
            at = _Entries.of(x, rep_rows, [infos[i].seen_tokens() for i in rep_rows])
            penalty = at.per_row([infos[i].params.repetition_penalty for i in rep_rows])
            vals = x[at.rows, at.cols]
            # Dividing a positive logit and multiplying a negative one both make the token less
            # likely, which is what the penalty means (CTRL paper's definition).
            x[at.rows, at.cols] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if add_rows:
            tables = [infos[i].output_tokens() for i in add_rows]
            at = _Entries.of(x, add_rows, tables)
            counts = at.select(torch.cat([t.counts for t in tables]).to(x.device))
            freq = at.per_row([infos[i].params.frequency_penalty for i in add_rows])
            pres = at.per_row([infos[i].params.presence_penalty for i in add_rows])
            x[at.rows, at.cols] -= freq * counts + pres
        return x

    def _mask_min_new_tokens(
        self,
        x: torch.Tensor,
        original: torch.Tensor,
        infos: list[SamplingInfo],
        eos_token_ids: list[int],
    ) -> torch.Tensor:
        vocab = x.shape[-1]
        rows: list[int] = []
        cols: list[int] = []
        for i, info in enumerate(infos):
            if len(info.output_ids) >= info.params.min_new_tokens:
                continue
            for t in (*eos_token_ids, *info.params.stop_token_ids):
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
        if not rows:
            return x
        if x is original:
            x = x.clone()
        r = torch.tensor(rows, dtype=torch.long, device=x.device)
        c = torch.tensor(cols, dtype=torch.long, device=x.device)
        x[r, c] = float("-inf")
        return x

    # ------------------------------------------------------------------ choosing tokens
    def _choose(
        self, x: torch.Tensor, infos: list[SamplingInfo], best_index: torch.Tensor
    ) -> torch.Tensor:
        """One token per row: `best_index` (each row's argmax) for greedy rows, a draw else."""
        batch = x.shape[0]
        sampled = [i for i, info in enumerate(infos) if not info.params.is_greedy]
        if not sampled:
            return best_index
        tokens = torch.empty(batch, dtype=torch.long, device=x.device)
        if len(sampled) < batch:
            sampled_set = set(sampled)
            greedy = [i for i in range(batch) if i not in sampled_set]
            put_rows(tokens, greedy, take_rows(best_index, greedy))
        # Unseeded rows are sampled together. Each seeded row is sampled on its own, so its
        # arithmetic (reduction splits, candidate counts) is bit-for-bit the same whatever
        # else is in the batch; otherwise rounding could flip a draw near a boundary.
        unseeded = [i for i in sampled if infos[i].generator is None]
        if unseeded:
            u = torch.rand(len(unseeded)).to(x.device)
            params = [infos[i].params for i in unseeded]
            picked = draw_tokens(take_rows(x, unseeded), params, u, self.num_candidates)
            put_rows(tokens, unseeded, picked)
        for i in sampled:
            generator = infos[i].generator
            if generator is not None:
                u = torch.rand(1, generator=generator).to(x.device)
                tokens[i : i + 1] = draw_tokens(
                    x[i : i + 1], [infos[i].params], u, self.num_candidates
                )
        return tokens

    # ------------------------------------------------------------------ logprobs
    def _report_logprobs(
        self,
        x: torch.Tensor,
        tokens: torch.Tensor,
        top_nums: list[int],
        return_logprobs: list[bool] | None,
    ) -> tuple[list[float], list[list[tuple[float, int]] | None]]:
        batch = x.shape[0]
        tops: list[list[tuple[float, int]] | None] = [None] * batch
        if return_logprobs is None:
            rows = list(range(batch))
        else:
            rows = [i for i in range(batch) if return_logprobs[i] or top_nums[i] > 0]
        logprobs = [float("nan")] * batch
        if not rows:
            return logprobs, tops
        lp = torch.log_softmax(take_rows(x, rows), dim=-1)
        chosen = lp.gather(1, take_rows(tokens, rows).unsqueeze(1)).squeeze(1).tolist()
        for i, value in zip(rows, chosen, strict=True):
            logprobs[i] = value
        want = [(j, i) for j, i in enumerate(rows) if top_nums[i] > 0]
        if want:
            k = min(max(top_nums[i] for _, i in want), lp.shape[-1])
            tv, ti = take_rows(lp, [j for j, _ in want]).topk(k, dim=-1)
            for (_, i), vs, ts in zip(want, tv.tolist(), ti.tolist(), strict=True):
                n = top_nums[i]
                tops[i] = list(zip(vs[:n], ts[:n], strict=True))
        return logprobs, tops


@dataclass
class _Entries:
    """The (row, column) positions of several rows' token tables, flattened for one gather."""

    rows: torch.Tensor
    cols: torch.Tensor
    lens: torch.Tensor
    inside: torch.Tensor | None  # set when some ids lie beyond the logits (then dropped)

    @classmethod
    def of(cls, x: torch.Tensor, rows: list[int], tables: list[TokenTable]) -> _Entries:
        """Entries of `tables[j]` in row `rows[j]` of `x`."""
        lens = torch.tensor([len(t) for t in tables], device=x.device)
        row_idx = torch.repeat_interleave(torch.tensor(rows, device=x.device), lens)
        cols = torch.cat([t.ids for t in tables]).to(x.device)
        inside = None
        if bool((cols >= x.shape[-1]).any()):  # a prompt id beyond the model's vocabulary
            inside = cols < x.shape[-1]
            row_idx, cols = row_idx[inside], cols[inside]
        return cls(row_idx, cols, lens, inside)

    def per_row(self, values: list[float]) -> torch.Tensor:
        """One value per row, repeated for each of that row's entries."""
        return self.select(torch.repeat_interleave(torch.tensor(values), self.lens.cpu()))

    def select(self, per_entry: torch.Tensor) -> torch.Tensor:
        """Drop the entries that were dropped from `cols`."""
        per_entry = per_entry.to(self.cols.device)
        return per_entry if self.inside is None else per_entry[self.inside]


def _row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max (NaN where the row has one) and its first index, in one pass: the native
    kernel on CPU (one pass on this thread, where PyTorch would dispatch a NaN check and a max as
    two reductions to its thread pool), else `max(dim=-1)` (one reduction giving both, which
    beats argmax on CPU)."""
    native = kernels.row_max(x)
    if native is not None:
        return native
    result = x.max(dim=-1)
    return result.values, result.indices
