"""bench_segments' answer quality against the reference configuration's answers: answer match,
token agreement, and the KL divergence of the output distributions over their top 20 tokens.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from benchmarks.segments_passes import Outcome


@dataclass
class Quality:
    answer_match: float
    token_agreement: float
    first_kl: float
    kl_k: float


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def top_kl(ref: list, got: list) -> float:
    """KL(ref || got) over the union of two top-k lists ([logprob, token_id, text] entries); a
    token missing from one side gets that side's smallest listed probability."""
    p = {int(tid): lp for lp, tid, *_ in ref}
    q = {int(tid): lp for lp, tid, *_ in got}
    union = p.keys() | q.keys()
    pv = {t: math.exp(p.get(t, min(p.values()))) for t in union}
    qv = {t: math.exp(q.get(t, min(q.values()))) for t in union}
    p_sum, q_sum = sum(pv.values()), sum(qv.values())
    return sum(pv[t] / p_sum * (math.log(pv[t] / p_sum) - math.log(qv[t] / q_sum)) for t in union)


def quality(ref: Outcome, got: Outcome, kl_tokens: int) -> Quality:
    matches, agreements, first, kl_k = [], [], [], []
    for r_ids, g_ids, r_top, g_top in zip(
        ref.answers, got.answers, ref.top_logprobs, got.top_logprobs, strict=True
    ):
        agree = common_prefix(r_ids, g_ids)
        matches.append(r_ids == g_ids)
        agreements.append(agree / max(len(r_ids), len(g_ids), 1))
        valid = min(kl_tokens, agree + 1, len(r_top), len(g_top))
        kls = [top_kl(r_top[i], g_top[i]) for i in range(valid)]
        first.append(kls[0] if kls else float("nan"))
        kl_k.append(statistics.fmean(kls) if kls else float("nan"))
    return Quality(
        statistics.fmean(matches),
        statistics.fmean(agreements),
        statistics.fmean(first),
        statistics.fmean(kl_k),
    )
