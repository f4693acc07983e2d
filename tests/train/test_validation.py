"""The bad-input matrix: every malformed request fails before compute with an error that
names the datum index and the field, and leaves parameters and accumulated gradients as
they were."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from furlong.errors import InputError
from furlong.types import Datum
from tests.train.helpers import engine, grads, params, random_datums


def with_input(key: str, value: object) -> Callable[[list[Datum]], list[Datum]]:
    def edit(data: list[Datum]) -> list[Datum]:
        d = data[1]
        inputs = dict(d.loss_fn_inputs)
        if value is None:
            inputs.pop(key)
        else:
            inputs[key] = value(d) if callable(value) else value
        return [data[0], Datum(d.model_input, inputs), *data[2:]]

    return edit


def with_tokens(value: Callable[[Datum], torch.Tensor]):
    def edit(data: list[Datum]) -> list[Datum]:
        d = data[1]
        return [data[0], Datum(value(d), d.loss_fn_inputs), *data[2:]]

    return edit


def nan_at(key: str, bad: float):
    def make(d: Datum) -> torch.Tensor:
        t = d.loss_fn_inputs[key].clone()
        t[2] = bad
        return t

    return make


# (case id, loss_fn, edit, expected message fragment)
CASES = [
    (
        "missing-targets",
        "cross_entropy",
        with_input("target_tokens", None),
        "datum 1: .*target_tokens.* missing",
    ),
    (
        "missing-weights",
        "cross_entropy",
        with_input("weights", None),
        "datum 1: .*'weights'.* missing",
    ),
    (
        "missing-advantages",
        "ppo",
        with_input("advantages", None),
        "datum 1: .*'advantages'.* missing",
    ),
    ("missing-logprobs", "dro", with_input("logprobs", None), "datum 1: .*'logprobs'.* missing"),
    (
        "short-weights",
        "cross_entropy",
        with_input("weights", lambda d: torch.ones(2)),
        "datum 1: .*'weights'.* shape",
    ),
    (
        "long-targets",
        "importance_sampling",
        with_input("target_tokens", lambda d: torch.ones(99, dtype=torch.long)),
        "datum 1: .*target_tokens.* shape",
    ),
    (
        "2d-targets-ppo",
        "ppo",
        with_input("target_tokens", lambda d: torch.ones(len(d), 2, dtype=torch.long)),
        "datum 1: .*target_tokens.* shape",
    ),
    (
        "target-out-of-vocab",
        "cispo",
        with_input("target_tokens", lambda d: torch.full((len(d),), 10**6)),
        "datum 1: .*target_tokens.* 1000000",
    ),
    (
        "negative-target",
        "cross_entropy",
        with_input("target_tokens", lambda d: torch.full((len(d),), -1)),
        "datum 1: .*target_tokens.* -1",
    ),
    (
        "input-out-of-vocab",
        "cross_entropy",
        with_tokens(lambda d: torch.full((len(d),), 5000)),
        "datum 1: model_input .* 5000",
    ),
    (
        "nan-weights",
        "cross_entropy",
        with_input("weights", nan_at("weights", float("nan"))),
        "datum 1: .*'weights'.* NaN",
    ),
    (
        "inf-advantages",
        "ppo",
        with_input("advantages", nan_at("advantages", float("inf"))),
        "datum 1: .*'advantages'.* NaN or inf",
    ),
    (
        "nan-logprobs",
        "importance_sampling",
        with_input("logprobs", nan_at("logprobs", float("nan"))),
        "datum 1: .*'logprobs'.* NaN",
    ),
    (
        "empty-input",
        "cross_entropy",
        with_tokens(lambda d: torch.zeros(0, dtype=torch.long)),
        "datum 1: model_input is empty",
    ),
]


@pytest.fixture(scope="module")
def trained():
    e = engine()
    e.forward_backward(random_datums([5, 7, 3]), "cross_entropy")  # accumulated gradients
    return e


def assert_untouched(e, before_params, before_grads) -> None:
    assert all(torch.equal(before_params[n], p) for n, p in params(e).items())
    assert all(torch.equal(before_grads[n], g) for n, g in grads(e).items())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("op", ["forward_backward", "forward"])
def test_bad_datum_is_rejected_without_side_effects(trained, case, op: str) -> None:
    _, loss_fn, edit, message = case
    data = edit(random_datums([5, 6, 4], loss_fn, seed=3))
    before_params, before_grads = params(trained), grads(trained)
    with pytest.raises(InputError, match=message):
        getattr(trained, op)(data, loss_fn)
    assert_untouched(trained, before_params, before_grads)


@pytest.mark.parametrize(
    "loss_fn, config, data, message",
    [
        ("sft", None, None, "loss_fn: unknown objective 'sft'"),
        ("ppo", {"clip_low_threshold": float("nan")}, None, "clip_low_threshold"),
        ("ppo", {"clip_low_threshold": 1.5}, None, "clip_low_threshold <= clip_high_threshold"),
        ("dro", {"beta": -1.0}, None, "beta"),
        ("cross_entropy", None, [], "non-empty list"),
        ("cross_entropy", None, ["not a datum"], "datum 0: expected a Datum"),
    ],
)
def test_bad_request_is_rejected_without_side_effects(trained, loss_fn, config, data, message):
    data = random_datums([4, 5], "ppo") if data is None else data
    before_params, before_grads = params(trained), grads(trained)
    with pytest.raises(InputError, match=message):
        trained.forward_backward(data, loss_fn, config)
    assert_untouched(trained, before_params, before_grads)


def test_too_long_datum_names_the_limit(trained) -> None:
    limit = trained.model.config.max_position_embeddings
    data = random_datums([4, limit + 1])
    with pytest.raises(InputError, match=f"datum 1: .*{limit + 1} tokens"):
        trained.forward(data, "cross_entropy")


def test_datum_construction_rejects_unreadable_inputs() -> None:
    with pytest.raises(InputError, match="model_input"):
        Datum([[1, 2], [3, 4]], {})
    with pytest.raises(InputError, match="target_tokens"):
        Datum([1, 2], {"target_tokens": [0.5, 1.5]})
    with pytest.raises(InputError, match="weights"):
        Datum([1, 2], {"target_tokens": [1, 2], "weights": ["a", "b"]})
