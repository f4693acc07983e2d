"""Splitting one call's datums across data-parallel ranks by tokens.

Every rank computes the same plan from the same request (no communication), takes its share,
and cuts it into microbatches by the token budget. FSDP collectives run once per microbatch
on every rank, so all ranks must run the same number of microbatches: a rank with fewer runs
padding microbatches (one ``PADDING`` datum, mask 0) that contribute zero loss and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

from furlong.train.batching import PADDING, plan_microbatches


def assign_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Request indices per rank, balanced by tokens: longest first, each to the rank with the
    fewest tokens so far (ties: the lower rank). Within a rank, indices keep request order."""
    if ranks < 1:
        raise ValueError(f"ranks: must be >= 1, got {ranks}")
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def rank_microbatches(
    lengths: Sequence[int], ranks: int, token_budget: int
) -> list[list[list[int]]]:
    """Per rank, its microbatches as lists of request indices; every rank gets the same count,
    padded with ``[PADDING]`` microbatches."""
    plans = []
    for share in assign_ranks(lengths, ranks):
        groups = plan_microbatches([lengths[i] for i in share], token_budget)
        plans.append([[share[j] for j in g] for g in groups])
    count = max(len(p) for p in plans)
    return [p + [[PADDING]] * (count - len(p)) for p in plans]
