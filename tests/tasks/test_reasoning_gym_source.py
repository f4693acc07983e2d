"""reasoning-gym as a task source: its generator builds disjoint splits from ``task.config``,
its own scorer rewards the extracted answer, the format term adds on top, and a reward that a
constant reply earns is refused before training."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from furlong.errors import InputError
from furlong.rl.config import TaskConfig, load_config, to_toml
from furlong.rl.task_sources import check_task_config, constant_scores, make_task

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning-gym is not installed (pip install 'furlong[tasks]')",
)

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "size": 120}


def chain_sum(**fields) -> TaskConfig:
    settings = {"name": "reasoning_gym:chain_sum", "config": CHAIN, "eval_size": 30}
    return TaskConfig(**(settings | {"extract": "last_number"} | fields))


def test_splits_are_the_generators_and_never_share_a_question() -> None:
    import reasoning_gym

    from furlong.rl.reasoning_gym_task import held_out

    task = make_task(chain_sum())
    drawn = list(reasoning_gym.create_dataset("chain_sum", seed=0, **CHAIN))
    train = [e for e in drawn if not held_out(e["question"])]
    assert 0.6 * len(drawn) < len(train) < len(drawn)  # a fifth of the questions held out
    assert [p.prompt for p in task.train] == [e["question"] for e in train]
    assert [p.answer for p in task.train] == [e["answer"] for e in train]
    assert len(task.eval) == 30
    questions = {p.prompt for p in task.train}
    assert not questions & {p.prompt for p in task.eval}
    assert len({p.prompt for p in task.eval}) == 30  # each held-out question once
    held = reasoning_gym.create_dataset("chain_sum", **CHAIN | {"seed": 1_000_003, "size": 300})
    assert all(p.metadata in list(held) for p in task.eval)  # drawn by the other seed
    # the entry rides along, for the scorer
    assert task.train[0].metadata["metadata"]["expression"] in task.train[0].prompt


def test_the_reward_is_the_datasets_scorer_on_the_extracted_answer() -> None:
    task = make_task(chain_sum(format_reward=0.25))
    problem = task.eval[0]
    right, wrong = int(problem.answer), int(problem.answer) + 1
    # "The answer is <n>." ends on the number: last_number takes it
    assert task.score(f"The answer is {right}.", problem).reward == pytest.approx(1.25)
    assert task.score(f"The answer is {right}.", problem, stopped=False).reward == 1.0
    scored = task.score(f"{right - 1} + 1 = {wrong}", problem)
    assert (scored.correct, scored.reward, scored.answer) == (0.0, 0.25, str(wrong))
    assert task.score("I do not know.", problem).reward == 0.0  # no answer: no format term
    # what the dataset itself says for the same entry
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("chain_sum", seed=0, **CHAIN)
    entry = dict(problem.metadata)
    assert dataset.score_answer(str(right), entry) == 1.0
    assert dataset.score_answer(str(wrong), entry) == 0.0


def test_answer_tags_are_the_default_extraction() -> None:
    task = make_task(chain_sum(extract="auto"))
    problem = task.eval[0]
    assert task.score(f"<answer>{problem.answer}</answer>", problem).correct == 1.0
    assert task.score(f"The answer is {problem.answer}.", problem).correct == 0.0


def test_a_template_wraps_the_question() -> None:
    task = make_task(chain_sum(template="{question}\nReply with the number only."))
    assert task.eval[0].prompt.endswith("=\nReply with the number only.")
    with pytest.raises(InputError, match=r"task.template: \{answer\} is not a field"):
        check_task_config(chain_sum(template="{question} {answer}"))


def test_config_knobs_reach_the_generator_and_bad_ones_are_named() -> None:
    three = make_task(chain_sum(config=CHAIN | {"min_terms": 3, "max_terms": 3}))
    assert all(p.prompt.count("+") + p.prompt.count("-") == 2 for p in three.train)
    with pytest.raises(InputError, match="task.config: reasoning-gym's 'chain_sum' refused"):
        make_task(chain_sum(config={"no_such_knob": 1}))
    with pytest.raises(InputError, match="no dataset 'chain_summ'.*chain_sum"):
        check_task_config(TaskConfig(name="reasoning_gym:chain_summ"))


def test_the_table_reads_from_toml_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[task]\nname = "reasoning_gym:chain_sum"\nextract = "last_number"\n'
        "config = {min_terms = 2, max_terms = 2, max_digits = 1, size = 50}\n"
    )
    config = load_config(path, ["task.config.min_terms=1", "task.config.allow_negation=true"])
    assert config.task.config == {
        "min_terms": 1,
        "max_terms": 2,
        "max_digits": 1,
        "size": 50,
        "allow_negation": True,
    }
    again = tmp_path / "again.toml"
    again.write_text(to_toml(config))
    assert load_config(again) == config
    with pytest.raises(InputError, match=r"task.config.x: expected a string, number, bool"):
        load_config(path, ["task.config.x={a = 1}"])


def test_a_constant_that_earns_the_reward_is_refused_or_reported() -> None:
    # coin_flip: the constant answer "0" scores ~0.9 with reasoning-gym's own scorer
    coin = TaskConfig(name="reasoning_gym:coin_flip", config={"size": 60}, eval_size=20)
    with pytest.raises(InputError, match=r"the constant reply '0' earns 9\d% of the reward"):
        make_task(coin)
    with pytest.warns(UserWarning, match="constant reply '0'"):
        make_task(TaskConfig(**{**coin.__dict__, "constant_check": "warn"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_task(TaskConfig(**{**coin.__dict__, "constant_check": "off"}))
    # chain_sum: no constant comes near
    scores = constant_scores(make_task(chain_sum()), "last_number")
    assert max(scores.values()) <= 0.10 and "" in scores and "0" in scores


def test_game_of_life_halting_pays_any_reply() -> None:
    halting = TaskConfig(name="reasoning_gym:game_of_life_halting", config={"size": 20})
    with pytest.raises(InputError, match="earns 100% of the reward"):
        make_task(halting)


def test_a_missing_install_is_one_line_naming_the_extra(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        "furlong.extras.find_spec", lambda m: None if m == "reasoning_gym" else real(m)
    )
    with pytest.raises(InputError) as error:
        check_task_config(chain_sum())
    message = str(error.value)
    assert "\n" not in message
    assert "reasoning_gym not installed" in message and "pip install 'furlong[tasks]'" in message
