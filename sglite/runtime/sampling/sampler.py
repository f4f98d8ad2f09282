"""The batched sampler: penalties, min_new_tokens, logprobs, temperature/top-k/top-p/min-p, draw.

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
5. the draw: inverse-CDF sampling with one uniform number per row.

Why inverse-CDF with one uniform per row: `torch.multinomial` and per-token exponential (Gumbel)
noise draw one random number per vocabulary entry, while a cumulative sum and a binary search need
one per row and a single streaming pass over the probabilities. It also makes seeding cheap: a
seeded row draws its uniform from its own CPU generator (the same sequence on any device). Unseeded
rows are sampled together, with uniforms from torch's default CPU generator (so `torch.manual_seed`
reproduces them in tests). Each seeded row is sampled on its own, so its arithmetic is bit-for-bit
the same whatever else is in the batch (batched reductions may split a row differently, and
rounding could flip a draw that lands near a boundary) - a seeded request gets the same tokens for
the same logits in any batch.

Top-k/top-p never sort the vocabulary (a full sort is O(V log V) per row, where the kept set is a
few dozen tokens). They take the best 64 candidates with `topk` (or the row's top_k, up to 256); a
row whose cut lies deeper is retried with 1024 candidates, and then goes through a bucketed path
that ranks tokens only in the log-probability bucket where the cut falls. All paths keep exactly
the same set as a full sort would and draw from it in vocabulary order, so the result never depends
on the path.

A row with a NaN logit or no finite one (a numerically broken model output) cannot be sampled;
it is reported in `SampleResult.invalid_rows` (its token is meaningless) so the caller can fail
that request alone instead of drawing from garbage or crashing the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sglite.runtime.model import kernels
from sglite.runtime.sampling.params import SamplingParams

_SEED_MASK = (1 << 64) - 1
# Truncated rows are first served from `topk` candidates: num_candidates (64), or the row's
# top_k up to MAX_CANDIDATES; a row whose cut lies deeper is retried with twice the estimated
# need while that stays within WIDE_CANDIDATES, else goes through the bucketed path. Each step
# costs more than the one before (a wider topk keeps a larger heap; the bucketed path makes
# several passes over the row) but less than a sort, and most rows stop at the first.
MAX_CANDIDATES = 256
WIDE_CANDIDATES = 1024
# Block width of the two-level inverse-CDF draw over a whole vocabulary.
CDF_BLOCK = 256
# The bucketed top-k/top-p path sorts tokens into NUM_BUCKETS buckets of log-probability
# spanning BUCKET_RANGE nats below the best token (1/64 nat each); everything further down
# shares the last bucket (its total mass is < vocab * e^-32, below float32 resolution).
NUM_BUCKETS = 2048
BUCKET_RANGE = 32.0
BUCKETED_ROWS_PER_PASS = 4


class TokenTable:
    """Distinct token ids and how often each occurred, as growable tensors.

    Penalties touch only tokens that occurred, so the sampler gathers and scatters these few
    hundred entries instead of making passes over [B, vocab] tensors. `add` is amortized O(1)
    (capacity doubles), so a decode step never recounts the history.
    """

    def __init__(self, device: torch.device, tokens: list[int] | None = None) -> None:
        self._pos: dict[int, int] = {}
        self._n = 0
        self._ids = torch.empty(16, dtype=torch.long, device=device)
        self._counts = torch.zeros(16, dtype=torch.float32, device=device)
        if tokens:
            distinct: dict[int, int] = {}
            for t in tokens:
                distinct[t] = distinct.get(t, 0) + 1
            self._reserve(len(distinct))
            self._pos = {t: i for i, t in enumerate(distinct)}
            self._n = len(distinct)
            self._ids[: self._n] = torch.tensor(list(distinct), dtype=torch.long)
            self._counts[: self._n] = torch.tensor(list(distinct.values()), dtype=torch.float32)

    def add(self, token: int) -> None:
        """Count one more occurrence of `token`."""
        pos = self._pos.get(token)
        if pos is None:
            self._reserve(self._n + 1)
            pos = self._pos[token] = self._n
            self._ids[pos] = token
            self._n += 1
        self._counts[pos] += 1

    @property
    def ids(self) -> torch.Tensor:
        """The distinct tokens, [n] int64."""
        return self._ids[: self._n]

    @property
    def counts(self) -> torch.Tensor:
        """Occurrences of each of `ids`, [n] float32 (all >= 1)."""
        return self._counts[: self._n]

    def __len__(self) -> int:
        return self._n

    def _reserve(self, n: int) -> None:
        cap = self._ids.shape[0]
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        ids = torch.empty(cap, dtype=torch.long, device=self._ids.device)
        counts = torch.zeros(cap, dtype=torch.float32, device=self._ids.device)
        ids[: self._n] = self._ids[: self._n]
        counts[: self._n] = self._counts[: self._n]
        self._ids, self._counts = ids, counts


@dataclass
class SamplingInfo:
    """Sampling state of one running request.

    The info owns `output_ids`: the scheduler reports each new token through `on_token`, which
    also updates the penalty tables, so a decode step never recounts the history. The tables
    exist only for requests that use penalties (built on first use).
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Prompt + output tokens (repetition penalty) and output tokens (frequency/presence).
    _seen: TokenTable | None = field(default=None, repr=False)
    _output: TokenTable | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        device: torch.device | str = "cpu",
        output_ids: list[int] | None = None,
    ) -> SamplingInfo:
        """A fresh info; a CPU generator seeded from `params.seed` when one is given."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed & _SEED_MASK)
        return cls(
            params=params,
            prompt_ids=list(prompt_ids),
            output_ids=list(output_ids or []),
            generator=generator,
            device=torch.device(device),
        )

    @property
    def uses_repetition_penalty(self) -> bool:
        """True when prompt+output tokens are penalized multiplicatively."""
        return self.params.repetition_penalty != 1.0

    @property
    def uses_additive_penalties(self) -> bool:
        """True when output tokens are penalized by count (frequency) or presence."""
        return self.params.frequency_penalty != 0.0 or self.params.presence_penalty != 0.0

    def skip_draw(self) -> None:
        """Advance a seeded sampled request's generator past one token's draw, as if this
        process had sampled it (a decode server taking over after the prefill server's first
        token)."""
        if self.generator is not None and not self.params.is_greedy:
            torch.rand(1, generator=self.generator)

    def on_token(self, token_id: int) -> None:
        """Record a generated token (appends to `output_ids`, updates the penalty tables)."""
        self.output_ids.append(token_id)
        if self._seen is not None:
            self._seen.add(token_id)
        if self._output is not None:
            self._output.add(token_id)

    def seen_tokens(self) -> TokenTable:
        """Distinct tokens of prompt + output (built on first call, then kept up to date)."""
        if self._seen is None:
            self._seen = TokenTable(self.device, self.prompt_ids + self.output_ids)
        return self._seen

    def output_tokens(self) -> TokenTable:
        """Distinct output tokens with counts (built on first call, then kept up to date)."""
        if self._output is None:
            self._output = TokenTable(self.device, self.output_ids)
        return self._output

    def release(self) -> None:
        """Drop the penalty tables (the request finished)."""
        self._seen = None
        self._output = None


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
            _write_rows(tokens, greedy, _rows(best_index, greedy))
        # Unseeded rows are sampled together. Each seeded row is sampled on its own, so its
        # arithmetic (reduction splits, candidate counts) is bit-for-bit the same whatever
        # else is in the batch; otherwise rounding could flip a draw near a boundary.
        unseeded = [i for i in sampled if infos[i].generator is None]
        if unseeded:
            u = torch.rand(len(unseeded)).to(x.device)
            params = [infos[i].params for i in unseeded]
            _write_rows(tokens, unseeded, self._sample_rows(_rows(x, unseeded), params, u))
        for i in sampled:
            generator = infos[i].generator
            if generator is not None:
                u = torch.rand(1, generator=generator).to(x.device)
                tokens[i : i + 1] = self._sample_rows(x[i : i + 1], [infos[i].params], u)
        return tokens

    def _sample_rows(
        self, x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
    ) -> torch.Tensor:
        """Draw one token per row of `x` (non-greedy rows), using uniforms `u`."""
        vocab = x.shape[-1]
        tokens = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        plain: list[int] = []
        truncated: list[int] = []
        for j, p in enumerate(params):
            (truncated if p.top_p < 1.0 or 0 < p.top_k < vocab else plain).append(j)
        if plain:
            picked = self._sample_plain(
                _rows(x, plain), [params[j] for j in plain], _rows(u, plain)
            )
            _write_rows(tokens, plain, picked)
        # Truncated rows: the best few candidates first; rows whose cut lies deeper are retried
        # with more candidates, then through the bucketed path. Every path draws from the same
        # kept set in the same (vocabulary) order.
        ks = [params[j].top_k for j in truncated]
        num = min(vocab, max([self.num_candidates, *(k for k in ks if 0 < k <= MAX_CANDIDATES)]))
        lse: torch.Tensor | None = None  # per truncated row, reused by the next stage
        deep: list[int] = []  # rows for the bucketed path
        while truncated:
            picked, covered, lse, need = self._sample_candidates(
                _rows(x, truncated), [params[j] for j in truncated], _rows(u, truncated), num, lse
            )
            done = [j for j, ok in enumerate(covered) if ok]
            if done:
                _write_rows(tokens, [truncated[j] for j in done], _rows(picked, done))
            # Retry with enough candidates if that stays a cheap topk, else go bucketed.
            again = [j for j, ok in enumerate(covered) if not ok and need[j] <= WIDE_CANDIDATES]
            retried = set(again)
            deep += [truncated[j] for j, ok in enumerate(covered) if not ok and j not in retried]
            if not again:
                break
            num = min(vocab, max(2 * num, _next_pow2(max(need[j] for j in again))))
            truncated = [truncated[j] for j in again]
            lse = _rows(lse, again) if lse is not None else None
        truncated = deep
        # The bucketed path makes many full-width temporaries; a few rows at a time keep them
        # in cache, where a whole batch's would spill to memory between passes.
        for start in range(0, len(truncated), BUCKETED_ROWS_PER_PASS):
            chunk = truncated[start : start + BUCKETED_ROWS_PER_PASS]
            picked = self._sample_bucketed(
                _rows(x, chunk), [params[j] for j in chunk], _rows(u, chunk)
            )
            _write_rows(tokens, chunk, picked)
        return tokens

    def _scale(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """x / temperature per row (no pass at all when every temperature is 1)."""
        temps = [p.temperature for p in params]
        if all(t == 1.0 for t in temps):
            return x
        return x / self._column(temps, x)

    def _sample_plain(
        self, x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
    ) -> torch.Tensor:
        """Temperature (+ min-p) over the whole vocabulary."""
        scaled = self._scale(x, params)
        # Weights relative to the best token: exp(0) = 1 at the max, so min-p is a plain compare.
        weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
        return _inverse_cdf(self._apply_min_p(weights, params), u)

    def _apply_min_p(self, weights: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Zero the weights (relative to the row's best, which is 1) below each row's min_p."""
        min_ps = [p.min_p for p in params]
        if all(m <= 0 for m in min_ps):
            return weights
        if all(m == min_ps[0] for m in min_ps):
            # One fused in-place pass; a comparison would write a [B, vocab] bool mask and then
            # read it back in a second pass.
            # threshold keeps w > t, so t is the float32 just below min_p (keeps w >= min_p).
            cut = torch.nextafter(torch.tensor(min_ps[0]), torch.tensor(0.0)).item()
            return torch.nn.functional.threshold_(weights, cut, 0.0)
        return torch.where(weights >= self._column(min_ps, weights), weights, 0.0)

    def _sample_candidates(
        self,
        x: torch.Tensor,
        params: list[SamplingParams],
        u: torch.Tensor,
        num: int,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[bool], torch.Tensor | None, list[float]]:
        """Top-k / top-p (+ temperature, min-p) on the best `num` tokens of each row.

        Returns the drawn tokens; per row, whether the result is exact (its top-k cut lies
        within the candidates or its nucleus is complete within them; other rows must be redone
        with more candidates, their token here is meaningless); and the rows' tempered
        logsumexp when top-p needed it (pass it back in to skip recomputing it); and how many
        candidates each row should get next (its top_k, or twice a lower bound for top-p).
        """
        vocab = x.shape[-1]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        temp = self._column([p.temperature for p in params], x)
        values, indices = x.topk(num, dim=-1)
        scaled = values / temp
        k_col = torch.tensor(ks, device=x.device).unsqueeze(1)
        keep = torch.arange(num, device=x.device).unsqueeze(0) < k_col
        covered = k_col.squeeze(1) <= num
        need = k_col.squeeze(1).to(x.dtype)  # candidates each row should get next time
        if any(p.top_p < 1.0 for p in params):
            # top_p == 1 rows are here for top-k only; an infinite threshold keeps float
            # rounding of the cumulative sum from ever cutting them.
            top_p = self._column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], x)
            if lse is None:
                lse = torch.logsumexp(self._scale(x, params), dim=-1, keepdim=True)
            probs = (scaled - lse).exp()
            cum = probs.cumsum(dim=-1)
            keep &= (cum - probs) < top_p
            covered |= cum[:, -1] >= top_p.squeeze(1)
            # Every token past the candidates is at most as likely as the last one, so at least
            # (missing mass / its probability) more are needed; ask for twice that.
            missing = (top_p.squeeze(1) - cum[:, -1]).clamp(min=0)
            need = torch.minimum(need, 2 * (num + missing / probs[:, -1]))
        weights = (scaled - scaled[:, :1]).exp()
        weights = self._apply_min_p(torch.where(keep, weights, 0.0), params)
        # Draw in vocabulary order, as the other paths do, so the token never depends on how
        # many candidates the batch asked for.
        order = indices.argsort(dim=-1)
        picked = _inverse_cdf(weights.gather(1, order), u)
        tokens = indices.gather(1, order.gather(1, picked.unsqueeze(1))).squeeze(1)
        return tokens, covered.tolist(), lse, need.tolist()

    def _sample_bucketed(
        self, x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
    ) -> torch.Tensor:
        """Exact top-k / top-p for wide cuts without sorting the vocabulary.

        Tokens go into buckets by log-probability (relative to the best token). Cumulative
        mass (and counts, for top-k) per bucket locate the bucket where the cut falls; only that
        bucket's tokens are ranked (a small topk), everything in better buckets is kept.
        """
        rows, vocab = x.shape
        scaled = self._scale(x, params)
        best = scaled.amax(dim=-1, keepdim=True)
        gap = best - scaled  # >= 0; +inf for masked tokens
        weights = gap.neg().exp_()
        buckets = (gap * (NUM_BUCKETS / BUCKET_RANGE)).clamp_(max=NUM_BUCKETS - 1).long()
        del gap
        mass = torch.zeros(rows, NUM_BUCKETS, dtype=x.dtype, device=x.device)
        mass.scatter_add_(1, buckets, weights)
        cum_mass = mass.cumsum(dim=-1)
        # Cut: keep while the mass before a token < top_p * total (and its rank < top_k).
        threshold = cum_mass[:, -1:] * self._column(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params], x
        )
        cut = torch.searchsorted(cum_mass, threshold)  # first bucket reaching the mass
        with_k = any(0 < p.top_k < vocab for p in params)
        if with_k:
            k_col = self._column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], x)
            count = torch.zeros(rows, NUM_BUCKETS, dtype=x.dtype, device=x.device)
            count.scatter_add_(1, buckets, torch.ones((), dtype=x.dtype).expand_as(x))
            cum_count = count.cumsum(dim=-1)
            cut = torch.minimum(cut, torch.searchsorted(cum_count, k_col))
        cut = cut.clamp_(max=NUM_BUCKETS - 1)
        prev = (cut - 1).clamp(min=0)
        keep = buckets < cut
        # Rank the tokens of the cut bucket and keep the prefix that respects both cuts.
        in_cut = buckets == cut
        width = int(in_cut.sum(dim=-1).max())
        if width > 0:
            vals, idx = torch.where(in_cut, scaled, float("-inf")).topk(width, dim=-1)
            w_cut = (vals - best).exp()
            base_mass = torch.where(cut > 0, cum_mass.gather(1, prev), 0.0)
            ok = (base_mass + w_cut.cumsum(dim=-1) - w_cut < threshold) & (vals > float("-inf"))
            if with_k:
                base_count = torch.where(cut > 0, cum_count.gather(1, prev), 0.0)
                rank = base_count + torch.arange(width, device=x.device, dtype=x.dtype)
                ok &= rank < k_col
            keep |= torch.zeros_like(keep).scatter_(1, idx, ok)
        weights = torch.where(keep, weights, 0.0)
        return _inverse_cdf(self._apply_min_p(weights, params), u)

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
        lp = torch.log_softmax(_rows(x, rows), dim=-1)
        chosen = lp.gather(1, _rows(tokens, rows).unsqueeze(1)).squeeze(1).tolist()
        for i, value in zip(rows, chosen, strict=True):
            logprobs[i] = value
        want = [(j, i) for j, i in enumerate(rows) if top_nums[i] > 0]
        if want:
            k = min(max(top_nums[i] for _, i in want), lp.shape[-1])
            tv, ti = _rows(lp, [j for j, _ in want]).topk(k, dim=-1)
            for (_, i), vs, ts in zip(want, tv.tolist(), ti.tolist(), strict=True):
                n = top_nums[i]
                tops[i] = list(zip(vs[:n], ts[:n], strict=True))
        return logprobs, tops

    @staticmethod
    def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


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


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when `rows` is every row in order."""
    if len(rows) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(rows, dtype=torch.long, device=t.device))


def _write_rows(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """t[rows] = values."""
    if len(rows) == t.shape[0]:
        if values is not t:
            t.copy_(values)
        return
    t.index_copy_(0, torch.tensor(rows, dtype=torch.long, device=t.device), values)


def _next_pow2(n: float) -> int:
    """The smallest power of two >= n (n may be inf: then a huge number)."""
    if n == float("inf") or n != n:
        return 1 << 62
    return 1 << max(0, math.ceil(math.log2(max(n, 1.0))))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i]; zero weights are never chosen.

    Wide rows go in two levels (block sums, then one block's cumulative sum): a sum reduction
    is vectorized where a full-width cumsum is a sequential scan.
    """
    rows, width = weights.shape
    if width <= 2 * CDF_BLOCK or rows < 4:  # few rows: the extra small ops cost more than a scan
        return _search(weights.cumsum(dim=-1), u)
    full = width // CDF_BLOCK * CDF_BLOCK
    sums = weights[:, :full].unflatten(1, (full // CDF_BLOCK, CDF_BLOCK)).sum(dim=-1)
    if full < width:
        sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    block_cdf = sums.cumsum(dim=-1)
    block = _search(block_cdf, u)
    before = torch.where(
        block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0
    )
    cols = block.unsqueeze(1) * CDF_BLOCK + torch.arange(CDF_BLOCK, device=weights.device)
    inside = cols < width
    local = weights.gather(1, cols.clamp(max=width - 1)) * inside
    inner = local.cumsum(dim=-1)
    # Re-target within the block; rounding between the two sums can leave the residual at or
    # past the block's own total, so clamp it strictly below (never lands on a zero weight).
    total = inner[:, -1]
    residual = torch.minimum(
        u.to(weights.dtype) * block_cdf[:, -1] - before,
        torch.nextafter(total, torch.zeros_like(total)),
    ).clamp(min=0)
    pos = torch.searchsorted(inner, residual.unsqueeze(1), right=True).squeeze(1)
    return block * CDF_BLOCK + pos


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative weight exceeds u * total (target kept strictly below)."""
    total = cdf[:, -1]
    # Strictly below the total, so the search never runs past the last positive weight.
    target = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    found = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return found.clamp_(max=cdf.shape[-1] - 1)  # only a row of NaNs gets here; stay in range
