"""The held-out evaluation the loop and ``furlong eval`` share: greedy accuracy, stop rate,
pass@1 and pass@k on scripted replies, checked by hand; the format term stays out of it."""

from __future__ import annotations

import math

import pytest

from furlong.models.loading import load_tokenizer
from furlong.rl import build, evaluation
from furlong.rl.evaluation import evaluate, pass_at_k
from furlong.rl.extract import last_number
from furlong.rl.tasks import Problem, Task, numeric
from furlong.rollout.base import GenerateResult
from furlong.rollout.sampling import SamplingParams


class Replies:
    """Answers request i with texts[i] (greedy first, then the sampled draws); a text ending
    in '...' is cut at max_tokens (no end token)."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.calls = tokenizer, list(texts), []

    def generate(self, prompts, params):
        self.calls.append([(p.temperature, p.seed) for p in params])
        results = []
        for i, prompt in enumerate(prompts):
            text = self.texts.pop(0)
            cut = text.endswith("...")
            ids = self.tokenizer(text)["input_ids"] + ([] if cut else [self.tokenizer.eos_token_id])
            reason = "length" if cut else "stop"
            results.append(GenerateResult(i, prompt, ids, [0.0] * len(ids), reason, None, 0))
        return results


PROBLEMS = [Problem("2 + 2?", "4"), Problem("3 + 5?", "8")]


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2) / C(4,2)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))


def test_greedy_stop_rate_pass1_and_pass_k_from_scripted_replies() -> None:
    tokenizer = load_tokenizer("tiny-qwen3")
    task = Task("t", PROBLEMS, PROBLEMS, numeric, last_number, format_reward=0.5)
    greedy = ["It is 4.", "It is 9..."]  # right and stopped; wrong and cut
    # problem 0's draws: 1 of 4 right (and that one cut: still correct, no format term)
    draws = ["4...", "5", "6", "no", "8", "8", "1", "8"]  # problem 1's: 3 of 4 right
    engine = Replies(tokenizer, greedy + draws)
    out = evaluate(engine, tokenizer, task, PROBLEMS, SamplingParams(max_tokens=8), 4, pass_k=2)
    assert out.metrics == {
        "eval_greedy": 0.5,
        "eval_solved": 0.5,
        "eval_stopped": 0.5,
        "eval_pass1": pytest.approx(4 / 8),
        "eval_pass@2": pytest.approx((0.5 + (1 - 0 / 6)) / 2),  # 1 - C(3,2)/C(4,2); C(1,2)=0
    }
    assert [(t, s) for t, s in engine.calls[0]] == [(0.0, None)] * 2
    assert [s for _, s in engine.calls[1]] == [evaluation.SAMPLED_SEED + i for i in range(8)]
    replies = out.replies
    assert [r.mode for r in replies] == ["greedy"] * 2 + ["sampled"] * 8
    first = replies[0]
    assert (first.prompt, first.reference, first.extracted) == ("2 + 2?", "4", "4")
    assert (first.correct, first.reward, first.stopped) == (1.0, 1.5, True)
    cut = replies[2]
    assert (cut.correct, cut.reward, cut.stopped) == (1.0, 1.0, False)
    assert replies[5].extracted is None and replies[5].reward == 0.0  # "no": nothing to take


def test_partial_credit_is_in_the_mean_but_not_in_solved() -> None:
    tokenizer = load_tokenizer("tiny-qwen3")

    def half(answer: str, problem: Problem) -> float:
        return {"4": 1.0, "44": 0.5}.get(answer, 0.0)

    task = Task("t", PROBLEMS, PROBLEMS, half, last_number)
    engine = Replies(tokenizer, ["4", "44"])
    out = evaluate(engine, tokenizer, task, PROBLEMS, SamplingParams(), 0)
    assert (out.metrics["eval_greedy"], out.metrics["eval_solved"]) == (0.75, 0.5)


def test_the_loop_evaluates_through_the_same_function() -> None:
    # and furlong eval repeats a run's last evaluation exactly (test_eval_command.py)
    assert build.evaluate is evaluation.evaluate
