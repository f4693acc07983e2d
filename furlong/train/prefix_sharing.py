"""Shared-prefix training passes: a group's common prompt runs through the trunk once.

GRPO scores ``group_size`` samples of every prompt; teacher-forcing them one row each runs the
prompt ``group_size`` times. Here each distinct prefix runs once with a KV cache, the cache is
gathered to every datum that shares it, and only the datums' own suffixes run on top. Causal
attention makes a prefix's hidden states independent of what follows, so the hidden rows are
the same as the plain pass up to float summation order, and gradients from every suffix reach
the prefix through the gathered cache.

Not used with routing replay (the routers see a different row layout) or activation
checkpointing (HF's checkpointed trunk refuses a cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache

# a decoder pass: (input_ids, attention_mask, position_ids, cache or None) -> hidden [B, T, H]
Trunk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Cache | None], torch.Tensor]

MIN_SAVING = 0.2  # share only when it removes at least this share of the tokens


@dataclass(frozen=True)
class PrefixPlan:
    prefix_ids: torch.Tensor  # [G, P] right-padded distinct prefixes
    prefix_mask: torch.Tensor  # [G, P]
    owner: torch.Tensor  # [B] the prefix of each datum slot
    suffix_ids: torch.Tensor  # [B, S] right-padded
    suffix_mask: torch.Tensor  # [B, S]
    suffix_positions: torch.Tensor  # [B, S] position ids: the prefix length onwards
    rows: torch.Tensor  # [R] each real token's row in cat(prefix rows, suffix rows)


def plan_prefixes(input_ids: torch.Tensor, lengths: list[int]) -> PrefixPlan | None:
    """Group the slots of a padded ``[B, T]`` microbatch by their common prefix; None when
    sharing would save less than :data:`MIN_SAVING` of the tokens."""
    # plain lists: the planning is integer bookkeeping, a tensor op per comparison is slow
    table = input_ids.tolist()
    seqs = [row[:n] for row, n in zip(table, lengths, strict=True)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, s in enumerate(seqs):
        groups.setdefault(tuple(s[:1]), []).append(j)
    # within each first-token bucket, split into groups sharing a longer prefix
    prefixes: list[list[int]] = []
    owner = [0] * len(seqs)
    for members in groups.values():
        for group in _split_by_prefix(seqs, members):
            # every member keeps at least one token of its own (its last row feeds the head)
            cap = min(len(seqs[j]) for j in group) - (1 if len(group) > 1 else 0)
            common = _common_prefix(seqs, group, cap)
            for j in group:
                owner[j] = len(prefixes)
            prefixes.append(seqs[group[0]][:common])
    plen = [len(p) for p in prefixes]
    suffix_len = [n - plen[owner[j]] for j, n in enumerate(lengths)]
    if sum(plen) + sum(suffix_len) > (1 - MIN_SAVING) * sum(lengths) or min(plen) == 0:
        return None
    width_p, width_s = max(plen), max(max(suffix_len), 1)
    n_prefix = len(prefixes)
    prefix_rows = [p + [0] * (width_p - len(p)) for p in prefixes]
    prefix_mask = [[1] * len(p) + [0] * (width_p - len(p)) for p in prefixes]
    suffix_rows: list[list[int]] = []
    suffix_mask: list[list[int]] = []
    rows: list[int] = []
    for j, s in enumerate(seqs):
        g, k = owner[j], plen[owner[j]]
        own = s[k:]
        suffix_rows.append(own + [0] * (width_s - len(own)))
        suffix_mask.append([1] * len(own) + [0] * (width_s - len(own)))
        rows += range(g * width_p, g * width_p + k)
        first = n_prefix * width_p + j * width_s
        rows += range(first, first + len(own))
    device, dtype = input_ids.device, input_ids.dtype
    owner_t = torch.tensor(owner, device=device)
    positions = torch.tensor(plen, device=device)[owner_t, None]
    return PrefixPlan(
        prefix_ids=torch.tensor(prefix_rows, dtype=dtype, device=device),
        prefix_mask=torch.tensor(prefix_mask, dtype=dtype, device=device),
        owner=owner_t,
        suffix_ids=torch.tensor(suffix_rows, dtype=dtype, device=device),
        suffix_mask=torch.tensor(suffix_mask, dtype=dtype, device=device),
        suffix_positions=positions + torch.arange(width_s, device=device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
    )


def _split_by_prefix(seqs: list[list[int]], members: list[int]) -> list[list[int]]:
    """Members that share their first token, split into the groups that save the most trunk
    tokens: sorted, a run of sequences shares the smallest common prefix of its neighbours,
    and a group of ``n`` sharing ``L`` tokens saves ``(n - 1) * L`` (an exact dynamic program
    over the runs). GRPO samples of one prompt share that prompt whatever their lengths, and
    prompts sharing only a chat template's first tokens stay apart when that saves more."""
    order = sorted(members, key=lambda j: seqs[j])
    n = len(order)
    lcp = [0] * n  # lcp[i]: common prefix of sorted i - 1 and i
    for i in range(1, n):
        a, b = seqs[order[i - 1]], seqs[order[i]]
        same, most = 0, min(len(a), len(b))
        while same < most and a[same] == b[same]:
            same += 1
        lcp[i] = same
    # best[i]: the most tokens saved by grouping sorted 0..i-1; cut[i]: where its last run starts
    best, cut = [0] * (n + 1), [0] * (n + 1)
    for i in range(1, n + 1):
        best[i], cut[i] = best[i - 1], i - 1  # order[i - 1] alone
        shared, shortest = len(seqs[order[i - 1]]), len(seqs[order[i - 1]])
        for start in range(i - 2, -1, -1):  # the run order[start .. i - 1]
            shared = min(shared, lcp[start + 1])
            shortest = min(shortest, len(seqs[order[start]]))
            if shared == 0:
                break
            saved = best[start] + (i - start - 1) * min(shared, shortest - 1)
            if saved > best[i]:
                best[i], cut[i] = saved, start
    groups, i = [], n
    while i:
        groups.append(sorted(order[cut[i] : i]))
        i = cut[i]
    return sorted(groups)  # by first member: the plan lists prefixes in datum order


def _common_prefix(seqs: list[list[int]], group: list[int], cap: int) -> int:
    head = seqs[group[0]][:cap]
    common = len(head)
    for j in group[1:]:
        seq = seqs[j]
        same = 0
        while same < common and seq[same] == head[same]:
            same += 1
        common = same
    return common


def shared_prefix_hidden(trunk: Trunk, plan: PrefixPlan) -> torch.Tensor:
    """The hidden rows ``[R, H]`` of every real token, in the plain pass's row order."""
    cache = DynamicCache()
    groups, width = plan.prefix_ids.shape
    positions = torch.arange(width, device=plan.prefix_ids.device).expand(groups, width)
    prefix = trunk(plan.prefix_ids, plan.prefix_mask, positions, cache)
    # index_select on the batch: differentiable. (transformers annotates torch.LongTensor, a
    # legacy class no int64 Tensor is typed as)
    cache.reorder_cache(plan.owner)  # type: ignore[arg-type]
    mask = torch.cat([plan.prefix_mask[plan.owner], plan.suffix_mask], dim=1)
    suffix = trunk(plan.suffix_ids, mask, plan.suffix_positions, cache)
    flat = torch.cat([prefix.reshape(-1, prefix.shape[-1]), suffix.reshape(-1, suffix.shape[-1])])
    return flat.index_select(0, plan.rows)
