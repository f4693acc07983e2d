"""Strict losses and ``gspo`` through the official ``tinker`` SDK against a real server.

A request its loss would refuse (an unknown ``loss_fn_config`` key, a positive sampler
log-prob, a loss furlong lacks) is refused at submission with HTTP 400 naming the field, and
still consumes its ``seq_id``: with a short gap timeout, an unconsumed one would fail the next
operation instead. A loss that overflows fails its future and applies nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types

from tests.server.test_sdk import BASE, client, rl_data, serve

pytestmark = pytest.mark.usefixtures("one_thread")
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def url(tmp_path_factory, one_thread):
    with serve(tmp_path_factory.mktemp("losses"), gap_timeout=3.0) as base_url:
        yield base_url


def edited(data: list[types.Datum], i: int, **inputs: np.ndarray) -> list[types.Datum]:
    d = data[i]
    new = types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, **inputs})
    return [*data[:i], new, *data[i + 1 :]]


def array(d: types.Datum, key: str) -> np.ndarray:
    return np.array(d.loss_fn_inputs[key].to_numpy(), dtype=np.float32)


@pytest.mark.parametrize(
    ("loss_fn", "config", "edit", "message"),
    [
        (
            "ppo",
            {"clip_lo": 0.5},
            None,
            "loss_fn_config: unknown key 'clip_lo' for 'ppo'; expected a subset of",
        ),
        ("importance_sampling", None, ("logprobs", 1, 3, 12.0), "a log-probability must be <= 0"),
        ("dro", None, ("advantages", 2, 0, -3e38), "|advantages| must be <= 1e+06"),
        ("stable_reinforce", None, None, "loss_fn: 'stable_reinforce' is not supported"),
        ("custom", None, None, "loss_fn: 'custom' is not supported by furlong"),
    ],
)
def test_refused_at_submission_and_the_seq_id_is_consumed(url, loss_fn, config, edit, message):
    training = client(url).create_lora_training_client(BASE, rank=4).result()
    data, _ = rl_data(3)
    if edit is not None:
        key, i, t, value = edit
        values = array(data[i], key)
        values[t] = value
        data = edited(data, i, **{key: values})
        message = (
            f"datum {i}: loss_fn_inputs[{key!r}][{t}] = {float(np.float32(value))}: " + message
        )
    with pytest.raises(tinker.BadRequestError) as info:
        training.forward_backward(data, loss_fn, config).result()
    assert info.value.status_code == 400 and message in str(info.value)
    # the next seq_id runs at once (a gap would fail it after gap_timeout)
    assert math.isfinite(training.forward(data[:1], "cross_entropy").result().metrics["loss:sum"])


def test_an_overflowing_loss_fails_and_the_next_step_is_unchanged(url) -> None:
    """Datum 1 token 2: sampler log-prob -700 and advantage -1, so r = exp(lp + 700) is inf
    in float32 and ppo's -min(r A, 1.2 A) is +inf: the future fails naming the loss, and the
    gradients it made are dropped (the step equals a run without the call)."""
    service = client(url)
    data, _ = rl_data(3)
    lp, adv = array(data[1], "logprobs"), array(data[1], "advantages")
    lp[2], adv[2] = -700.0, -1.0
    bad = edited(data, 1, logprobs=lp, advantages=adv)
    losses = []
    for refused in (True, False):
        training = service.create_lora_training_client(BASE, rank=4, seed=7).result()
        training.forward_backward(data[:1], "ppo").result()
        if refused:
            with pytest.raises(tinker.RequestFailedError, match="datum 1: the ppo loss is inf"):
                training.forward_backward(bad, "ppo").result()
        training.optim_step(ADAM).result()
        losses.append(training.forward(data, "cross_entropy").result().metrics["loss:sum"])
    assert losses[0] == losses[1]


def _gspo_loss(logprobs: list[np.ndarray], data: list[types.Datum], lo: float, hi: float):
    """GSPO-token's value, in float64, from the log-probs the server returned."""
    total = 0.0
    for lp, d in zip(logprobs, data, strict=True):
        lp = lp.astype(np.float64)
        s, a = array(d, "logprobs"), array(d, "advantages")
        marked = array(d, "sequence_ratio_mask") != 0
        q = math.exp(float(np.mean(lp[marked] - s[marked])))
        total -= float(np.minimum(q * a, min(max(q, lo), hi) * a).sum())
    return total


def test_gspo_returns_the_expected_loss_sum(url) -> None:
    training = client(url).create_lora_training_client(BASE, rank=4).result()
    data, _ = rl_data(4)
    with_mask = []
    for d in data:
        mask = np.ones(len(array(d, "logprobs")), dtype=np.float32)
        mask[:3] = 0.0  # prompt-like positions outside the sequence ratio
        with_mask.append(edited([d], 0, sequence_ratio_mask=mask)[0])
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    out = training.forward_backward(with_mask, "gspo", config).result()
    logprobs = [np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]
    want = _gspo_loss(logprobs, with_mask, 0.9, 1.1)
    assert want != 0.0
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-4)
