"""Shared-prompt training passes group sequences by the prompt they share even when the
responses are longer than the prompt (the 32-token benchmark case used to share nothing)."""

from __future__ import annotations

import torch

from furlong.train.prefix_sharing import plan_prefixes


def test_long_responses_still_share_their_prompt() -> None:
    g = torch.Generator().manual_seed(0)
    template = torch.randint(3, 700, (6,), generator=g)  # a chat template's common head
    seqs = []
    for _ in range(4):
        prompt = torch.cat([template, torch.randint(3, 700, (9,), generator=g)])
        for _ in range(8):  # 31-token responses: twice the prompt
            seqs.append(torch.cat([prompt, torch.randint(3, 700, (31,), generator=g)]))
    lengths = [len(s) for s in seqs]
    ids = torch.stack(seqs)
    plan = plan_prefixes(ids, lengths)
    assert plan is not None
    assert plan.owner.tolist() == [i // 8 for i in range(32)]
    assert plan.prefix_mask.sum(1).tolist() == [15] * 4
    assert plan.rows.numel() == sum(lengths)
