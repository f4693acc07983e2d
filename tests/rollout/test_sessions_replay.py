"""Replay equality for a multi-turn MoE trajectory served by the session server.

The rollout engine selects experts by router probability plus a fixed per-layer bias (a
load-balancing bias used for selection only, as DeepSeek-V3's routers do) and weights them with
the unbiased probabilities: the same weighting rule the trainer's replay applies. So the
engine's routes differ from the trainer's own top-k while everything else is identical. With
the assembled rows replayed, the trainer's log-probs of every sampled token across all turns
equal the engine's within 1e-5 (a row misaligned by one position would break this); without
replay they differ."""

from __future__ import annotations

import copy

import pytest
import torch

from furlong.models.moe import find_routers
from furlong.rollout.codec import opt_in
from furlong.rollout.engine import EmbeddedEngine
from furlong.rollout.sessions.wire import sample_from_json
from furlong.train.engine import TrainingEngine
from tests.train.helpers import sequence_datum

from .session_helpers import model, open_session, serve, turn

pytestmark = pytest.mark.usefixtures("one_thread")


def select_with_bias(net: torch.nn.Module, scale: float = 0.1, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for router in find_routers(net):
        bias = scale * torch.randn(router.num_experts, generator=g)

        def hook(module, _inputs, outputs, bias=bias):
            logits = outputs[0]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            chosen = torch.topk(probs + bias, module.top_k, dim=-1).indices
            scores = probs.gather(-1, chosen)
            if module.norm_topk_prob:
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), chosen

        router.register_forward_hook(hook)


@pytest.mark.parametrize("mode", ["in_place", "retract"])  # incremental and full R3
def test_trainer_logprobs_equal_the_engines_with_replay_only(mode: str) -> None:
    net, tokenizer = model("tiny-qwen3-moe")
    trainer = TrainingEngine(net, tokenizer)
    rollout = copy.deepcopy(net)
    select_with_bias(rollout)
    engine = EmbeddedEngine(rollout, tokenizer)
    with serve(engine=engine, pause_mode=mode) as (_, _, client):
        sid = open_session(client)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        for i, follow_up in enumerate(
            [{"role": "tool", "content": "5"}, {"role": "user", "content": "And 4 + 4?"}, None]
        ):
            messages.append(turn(client, sid, messages, seed=i, max_tokens=10))
            if follow_up is not None:
                messages.append(follow_up)
        body = client.post(f"/sessions/{sid}/samples?fields=routed_experts").json()
    sample = sample_from_json(body["samples"][0], opt_in("routed_experts"))
    tokens = sample.tokens
    assert sample.routed_experts.shape[0] == tokens.numel() - 1
    assert int((sample.loss_mask == 0).sum()) > 0 and int(sample.loss_mask.sum()) >= 3

    datum = sequence_datum(tokens)
    sampled = sample.loss_mask > 0  # the model's tokens of all three turns

    def trainer_logprobs(routes) -> torch.Tensor:
        out = trainer.forward([datum], "cross_entropy", routed_experts=routes)
        return out.outputs[0]["logprobs"][-sample.response_length :][sampled]

    engine_lp = sample.rollout_logprobs[sampled]
    replayed = trainer_logprobs([sample.routed_experts])
    torch.testing.assert_close(replayed, engine_lp, atol=1e-5, rtol=0)
    own_choice = trainer_logprobs(None)
    assert (own_choice - engine_lp).abs().max() > 1e-3  # 100x the tolerance above
