"""The vLLM kind's config rules, said at config time in one line each (no server involved),
and the rollout correction (algo.tis_cap) it is documented with."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.errors import InputError
from furlong.rl.config import load_config
from furlong.rl.rollout_correction import truncated_is
from furlong.rollout import vllm_venv

VLLM = ['rollout.engine="vllm"', 'rollout.urls=["http://127.0.0.1:8000"]']


def check(*overrides: str) -> None:
    load_config(None, list(overrides)).validate()


def test_a_vllm_config_validates_offline():
    check(*VLLM)
    check('rollout.engine="vllm"', 'rollout.vllm_python="auto"')


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ['rollout.engine="vllm"'],
            r"rollout\.urls / rollout\.vllm_python: the vLLM engine needs exactly one",
        ),
        ([*VLLM, 'rollout.vllm_python="auto"'], r"needs exactly one"),
        (
            ['rollout.vllm_python="auto"'],
            r'rollout\.vllm_python: only used with rollout\.engine = "vllm"',
        ),
        (
            [*VLLM, "rollout.top_p=0.9"],
            r"rollout\.top_p / rollout\.top_k: truncated sampling .* kept sets",
        ),
        ([*VLLM, "rollout.top_k=20"], r"sampling-mask replay"),
        (
            [*VLLM, "colocate.enabled=true"],
            r"colocate\.enabled: vLLM's CPU worker ignores sleep/wake_up",
        ),
        ([*VLLM, 'rollout.vllm_transport="ipc"'], r"rollout\.vllm_transport: 'ipc' is not one of"),
        ([*VLLM, "rollout.vllm_threads=-1"], r"rollout\.vllm_threads: must be >= 0"),
        ([*VLLM, 'scale.ray="local"'], r"the scale-out places its own engines"),
        (["algo.tis_cap=-1"], r"algo\.tis_cap: must be finite and >= 0"),
    ],
)
def test_what_vllm_cannot_do_is_refused_by_field(overrides: list[str], message: str):
    with pytest.raises(InputError, match=message):
        check(*overrides)


def test_auto_names_the_missing_venv_and_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_venv.VENV_ENV, str(tmp_path / "none"))
    with pytest.raises(InputError, match=r'rollout\.vllm_python: "auto" .* run `make vllm-venv`'):
        vllm_venv.resolve_python("auto")
    with pytest.raises(
        InputError, match=r"rollout\.vllm_python: '/nope/python' is not an executable"
    ):
        vllm_venv.resolve_python("/nope/python")
    built = tmp_path / "venv"
    (built / "bin").mkdir(parents=True)
    (built / "bin" / "python").write_text("")
    (built / vllm_venv.STAMP).write_text("")
    monkeypatch.setenv(vllm_venv.VENV_ENV, str(built))
    assert vllm_venv.resolve_python("auto") == built / "bin" / "python"


def test_truncated_is_by_hand():
    trainer = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.25])]
    rollout = [torch.tensor([-1.5, -0.5]), torch.tensor([-0.25])]
    weights, metrics = truncated_is(trainer, rollout, cap=1.5)
    # exp(0.5) = 1.6487 -> 1.5 (truncated); exp(-1.5) = 0.2231; exp(0) = 1
    torch.testing.assert_close(weights[0], torch.tensor([1.5, math.exp(-1.5)]))
    torch.testing.assert_close(weights[1], torch.tensor([1.0]))
    assert metrics["tis_truncated:frac"] == pytest.approx(1 / 3)
    assert metrics["tis_weight:mean"] == pytest.approx((1.5 + math.exp(-1.5) + 1.0) / 3)
    assert metrics["tis_logprob_gap:max"] == pytest.approx(1.5)


def test_truncated_is_weights_carry_no_gradient():
    """The weight is a constant of the step: the gradient flows through the objective's ratio
    (against the trainer's own detached log-probs), never through the correction."""
    trainer = torch.tensor([-1.0, -2.0], requires_grad=True)
    weights, _ = truncated_is([trainer], [torch.tensor([-1.2, -1.9])], cap=2.0)
    assert not weights[0].requires_grad
    ratio = torch.exp(trainer - trainer.detach())
    loss = -(ratio * weights[0] * torch.tensor([1.0, -1.0])).sum()
    loss.backward()
    # d/dlp of -(exp(lp - lp_old) * w * A) at lp = lp_old is -w * A
    torch.testing.assert_close(trainer.grad, -weights[0] * torch.tensor([1.0, -1.0]))
