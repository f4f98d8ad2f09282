"""Drawing a token from each row's filtered distribution: temperature, top-k, top-p, min-p, then
an inverse-CDF draw with one uniform number per row (`draw_tokens`).

Why inverse-CDF with one uniform per row: `torch.multinomial` and per-token exponential (Gumbel)
noise draw one random number per vocabulary entry, while a cumulative sum and a binary search need
one per row and a single streaming pass over the probabilities. It also makes seeding cheap: the
caller gives each row its uniform (a seeded row's from its own generator).

Top-k/top-p never sort the vocabulary (a full sort is O(V log V) per row, where the kept set is a
few dozen tokens). They take the best 64 candidates with `topk` (or the row's top_k, up to 256); a
row whose cut lies deeper is retried with 1024 candidates, and then goes through a bucketed path
that ranks tokens only in the log-probability bucket where the cut falls. All paths keep exactly
the same set as a full sort would and draw from it in vocabulary order, so the result never depends
on the path.
"""

from __future__ import annotations

import math

import torch

from sglite.runtime.sampling.params import SamplingParams

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


def draw_tokens(
    x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """One token per row of `x` (non-greedy rows) drawn with uniforms `u`; truncated rows start
    from their best `num_candidates` tokens (module docstring)."""
    vocab = x.shape[-1]
    tokens = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    plain: list[int] = []
    truncated: list[int] = []
    for j, p in enumerate(params):
        (truncated if p.top_p < 1.0 or 0 < p.top_k < vocab else plain).append(j)
    if plain:
        picked = _sample_plain(take_rows(x, plain), [params[j] for j in plain], take_rows(u, plain))
        put_rows(tokens, plain, picked)
    # Truncated rows: the best few candidates first; rows whose cut lies deeper are retried
    # with more candidates, then through the bucketed path. Every path draws from the same
    # kept set in the same (vocabulary) order.
    ks = [params[j].top_k for j in truncated]
    num = min(vocab, max([num_candidates, *(k for k in ks if 0 < k <= MAX_CANDIDATES)]))
    lse: torch.Tensor | None = None  # per truncated row, reused by the next stage
    deep: list[int] = []  # rows for the bucketed path
    while truncated:
        picked, covered, lse, need = _sample_candidates(
            take_rows(x, truncated),
            [params[j] for j in truncated],
            take_rows(u, truncated),
            num,
            lse,
        )
        done = [j for j, ok in enumerate(covered) if ok]
        if done:
            put_rows(tokens, [truncated[j] for j in done], take_rows(picked, done))
        # Retry with enough candidates if that stays a cheap topk, else go bucketed.
        again = [j for j, ok in enumerate(covered) if not ok and need[j] <= WIDE_CANDIDATES]
        retried = set(again)
        deep += [truncated[j] for j, ok in enumerate(covered) if not ok and j not in retried]
        if not again:
            break
        num = min(vocab, max(2 * num, _next_pow2(max(need[j] for j in again))))
        truncated = [truncated[j] for j in again]
        lse = take_rows(lse, again) if lse is not None else None
    truncated = deep
    # The bucketed path makes many full-width temporaries; a few rows at a time keep them
    # in cache, where a whole batch's would spill to memory between passes.
    for start in range(0, len(truncated), BUCKETED_ROWS_PER_PASS):
        chunk = truncated[start : start + BUCKETED_ROWS_PER_PASS]
        picked = _sample_bucketed(
            take_rows(x, chunk), [params[j] for j in chunk], take_rows(u, chunk)
        )
        put_rows(tokens, chunk, picked)
    return tokens


def _scale(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x / temperature per row (no pass at all when every temperature is 1)."""
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        return x
    return x / _column(temps, x)


def _sample_plain(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Temperature (+ min-p) over the whole vocabulary."""
    scaled = _scale(x, params)
    # Weights relative to the best token: exp(0) = 1 at the max, so min-p is a plain compare.
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    return _inverse_cdf(_apply_min_p(weights, params), u)


def _apply_min_p(weights: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
    return torch.where(weights >= _column(min_ps, weights), weights, 0.0)


def _sample_candidates(
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
    temp = _column([p.temperature for p in params], x)
    values, indices = x.topk(num, dim=-1)
    scaled = values / temp
    k_col = torch.tensor(ks, device=x.device).unsqueeze(1)
    keep = torch.arange(num, device=x.device).unsqueeze(0) < k_col
    covered = k_col.squeeze(1) <= num
    need = k_col.squeeze(1).to(x.dtype)  # candidates each row should get next time
    if any(p.top_p < 1.0 for p in params):
        # top_p == 1 rows are here for top-k only; an infinite threshold keeps float
        # rounding of the cumulative sum from ever cutting them.
        top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], x)
        if lse is None:
            lse = torch.logsumexp(_scale(x, params), dim=-1, keepdim=True)
        probs = (scaled - lse).exp()
        cum = probs.cumsum(dim=-1)
        keep &= (cum - probs) < top_p
        covered |= cum[:, -1] >= top_p.squeeze(1)
        # Every token past the candidates is at most as likely as the last one, so at least
        # (missing mass / its probability) more are needed; ask for twice that.
        missing = (top_p.squeeze(1) - cum[:, -1]).clamp(min=0)
        need = torch.minimum(need, 2 * (num + missing / probs[:, -1]))
    weights = (scaled - scaled[:, :1]).exp()
    weights = _apply_min_p(torch.where(keep, weights, 0.0), params)
    # Draw in vocabulary order, as the other paths do, so the token never depends on how
    # many candidates the batch asked for.
    order = indices.argsort(dim=-1)
    picked = _inverse_cdf(weights.gather(1, order), u)
    tokens = indices.gather(1, order.gather(1, picked.unsqueeze(1))).squeeze(1)
    return tokens, covered.tolist(), lse, need.tolist()


def _sample_bucketed(
    x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Exact top-k / top-p for wide cuts without sorting the vocabulary.

    Tokens go into buckets by log-probability (relative to the best token). Cumulative
    mass (and counts, for top-k) per bucket locate the bucket where the cut falls; only that
    bucket's tokens are ranked (a small topk), everything in better buckets is kept.
    """
    rows, vocab = x.shape
    scaled = _scale(x, params)
    best = scaled.amax(dim=-1, keepdim=True)
    gap = best - scaled  # >= 0; +inf for masked tokens
    weights = gap.neg().exp_()
    buckets = (gap * (NUM_BUCKETS / BUCKET_RANGE)).clamp_(max=NUM_BUCKETS - 1).long()
    del gap
    mass = torch.zeros(rows, NUM_BUCKETS, dtype=x.dtype, device=x.device)
    mass.scatter_add_(1, buckets, weights)
    cum_mass = mass.cumsum(dim=-1)
    # Cut: keep while the mass before a token < top_p * total (and its rank < top_k).
    threshold = cum_mass[:, -1:] * _column(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], x
    )
    cut = torch.searchsorted(cum_mass, threshold)  # first bucket reaching the mass
    with_k = any(0 < p.top_k < vocab for p in params)
    if with_k:
        k_col = _column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], x)
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
    return _inverse_cdf(_apply_min_p(weights, params), u)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when `rows` is every row in order."""
    if len(rows) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(rows, dtype=torch.long, device=t.device))


def put_rows(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
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
