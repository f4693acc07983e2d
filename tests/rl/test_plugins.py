"""Plug-in tasks and rewards: ``task.name`` / ``task.reward = "module:function"`` import the
user's function, validated when the config is; the verifier's values become the episodes'
rewards, end to end; docs/rl.md's example runs as written."""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

from furlong import cli
from furlong.errors import InputError
from furlong.models.loading import load_tokenizer
from furlong.rl.config import load_config, to_toml
from furlong.rl.episodes import generate_episodes
from furlong.rl.loop import train
from furlong.rl.tasks import Problem, build_task
from furlong.rollout.base import GenerateResult
from furlong.rollout.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_reward"

pytestmark = pytest.mark.usefixtures("one_thread")

# records every call, so a test can compare what the loop logged with what the plug-in returned
REWARD_SOURCE = """
CALLS = []
NOT_A_FUNCTION = 3


def score(response, problem):
    value = len(response) % 3
    CALLS.append((response, problem, value))
    return value
"""

TASK_SOURCE = """
from furlong.rl.tasks import Problem

KWARGS = []


def problems(**kwargs):
    KWARGS.append(kwargs)
    train = [Problem(f"Say {w}", w) for w in ("one", "two", "three", "four", "five")]
    held = [Problem(f"Repeat {w}", w) for w in ("six", "seven", "eight")]
    return train, held


def not_lists(**kwargs):
    return "train", "eval"
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Write ``name.py`` into an importable directory; the modules are forgotten afterwards so
    no test sees another's."""
    names: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)

    yield write
    for name in names + ["my_reward", "my_task"]:  # the example's, imported from its directory
        sys.modules.pop(name, None)


class ScriptedEngine:
    """Answers every prompt with the next of hand-chosen texts (then an end-of-sequence)."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]):
        assert len(prompts) == len(self.texts) == len(params)
        results = []
        for i, (prompt, text) in enumerate(zip(prompts, self.texts, strict=True)):
            ids = self.tokenizer(text)["input_ids"] + [self.tokenizer.eos_token_id]
            results.append(GenerateResult(i, prompt, ids, [0.0] * len(ids), "stop", None, 0))
        return results


def test_a_plugin_reward_scores_every_episode(plugins) -> None:
    plugins("lengths", REWARD_SOURCE)
    task = build_task("addition", "lengths:score", max_a=3, max_b=2)
    tokenizer = load_tokenizer("tiny-qwen3")
    texts = ["7", "12", "no idea", "", "3+4=7", "seven!"]
    engine = ScriptedEngine(tokenizer, texts)
    problems = task.train[:2]
    episodes = generate_episodes(engine, tokenizer, problems, 3, SamplingParams(), task)
    assert [e.reward for e in episodes] == [1.0, 2.0, 1.0, 0.0, 2.0, 0.0]  # by hand
    assert [e.reward for e in episodes] == [float(len(t) % 3) for t in texts]
    assert all(type(e.reward) is float for e in episodes)  # the plug-in's ints, as floats
    calls = sys.modules["lengths"].CALLS
    assert [(r, p) for r, p, _ in calls] == [(t, problems[i // 3]) for i, t in enumerate(texts)]


def test_a_plugin_task_supplies_the_problems(plugins) -> None:
    plugins("wordtask", TASK_SOURCE)
    config = load_config(None, ["task.name=wordtask:problems", "task.path=data.txt"])
    t = config.task
    task = build_task(t.name, t.reward, t.path, t.max_a, t.max_b)
    assert sys.modules["wordtask"].KWARGS == [{"path": "data.txt", "max_a": 99, "max_b": 9}]
    assert [p.answer for p in task.train] == ["one", "two", "three", "four", "five"]
    assert sorted(p.answer for p in task.eval) == ["eight", "seven", "six"]
    assert task.name == "wordtask:problems"


def test_the_example_task_function(plugins, monkeypatch) -> None:
    monkeypatch.chdir(EXAMPLE)  # found in the working directory, as the docs say
    task = build_task("my_task:squares", "exact_number", max_a=30)
    assert len(task.train) == 24 and len(task.eval) == 7
    assert {p.prompt for p in task.train}.isdisjoint(p.prompt for p in task.eval)
    ten = next(p for p in task.train + task.eval if p.prompt == "What is 10 squared?")
    assert task.reward("100", ten) == 1.0


def test_plugin_strings_survive_the_toml_round_trip(plugins, tmp_path) -> None:
    plugins("lengths", REWARD_SOURCE)
    plugins("wordtask", TASK_SOURCE)
    config = load_config(None, ["task.name=wordtask:problems", "task.reward=lengths:score"])
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config))
    again = load_config(path)
    assert again == config
    assert (again.task.name, again.task.reward) == ("wordtask:problems", "lengths:score")


@pytest.mark.parametrize("field", ["task.reward", "task.name"])
@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_module_xyz:score", r"cannot import 'no_such_module_xyz': ModuleNotFoundError"),
        ("broken:score", r"cannot import 'broken': .*No module named 'not_installed_dep'"),
        ("lengths:missing", r"module 'lengths' has no attribute 'missing'"),
        ("lengths:NOT_A_FUNCTION", r"'lengths:NOT_A_FUNCTION' is not callable \(a int\)"),
        (":score", r"':score' is not of the form 'module:function'"),
        ("lengths:", r"'lengths:' is not of the form"),
    ],
)
def test_a_bad_function_path_names_its_field(plugins, field, spec, message) -> None:
    plugins("lengths", REWARD_SOURCE)
    plugins("broken", "import not_installed_dep\n")
    with pytest.raises(InputError, match=f"^{re.escape(field)}: {message}"):
        load_config(None, [f"{field}={spec}"])


def test_unknown_builtin_names_still_fail_at_config_time() -> None:
    with pytest.raises(InputError, match=r"^task.name: unknown 'nope'.*'module:function'"):
        load_config(None, ["task.name=nope"])
    with pytest.raises(InputError, match=r"^task.reward: unknown 'nope'"):
        load_config(None, ["task.reward=nope"])


def test_a_task_function_must_return_two_lists_of_problems(plugins) -> None:
    plugins("wordtask", TASK_SOURCE)
    load_config(None, ["task.name=wordtask:not_lists"])  # importable: it runs only when built
    with pytest.raises(InputError, match=r"^task.name: wordtask:not_lists must return"):
        build_task("wordtask:not_lists", "exact_number")


@pytest.mark.parametrize("value", ["None", "float('nan')", "'1'"])
def test_a_reward_that_is_not_a_finite_number_stops_the_run(plugins, value) -> None:
    plugins("bad", f"def score(response, problem):\n    return {value}\n")
    task = build_task("addition", "bad:score", max_a=3, max_b=2)
    with pytest.raises(InputError, match=r"^task.reward: bad:score returned .* finite float"):
        task.reward("7", Problem("What is 3 + 4?", "7"))


def test_a_run_logs_the_plugin_rewards(plugins, tmp_path) -> None:
    plugins("lengths", REWARD_SOURCE)
    plugins("wordtask", TASK_SOURCE)
    prompts, group, steps = 2, 3, 2
    out = tmp_path / "run"
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "task.name=wordtask:problems",
            "task.reward=lengths:score",
            "task.eval_samples=0",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.group_size={group}",
            "rollout.max_tokens=4",
            f"run.steps={steps}",
            f"run.eval_every={steps}",
            "run.export_hf=false",
            "run.log_kl=false",
            "run.progress=false",
            f"run.out_dir={out}",
        ],
    )
    train(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r["reward:mean"] for r in rows if "reward:mean" in r]
    # the training samples are the calls on train problems ("Say ..."), one batch per step
    calls = sys.modules["lengths"].CALLS
    assert all(v == len(r) % 3 for r, _, v in calls)
    values = [v for _, p, v in calls if p.prompt.startswith("Say")]
    batch = prompts * group
    assert len(values) == steps * batch
    expected = [sum(values[i : i + batch]) / batch for i in range(0, len(values), batch)]
    assert logged == pytest.approx(expected)
    assert {p.prompt.split()[0] for _, p, _ in calls} == {"Say", "Repeat"}  # evaluated too
    assert load_config(out / "config.toml").task.reward == "lengths:score"


def _documented_command() -> tuple[str, list[str]]:
    """The page's ``cd <dir> && furlong train ...`` line for the custom reward."""
    page = (ROOT / "docs" / "rl.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", page, flags=re.S):
        line = " ".join(block.replace("\\\n", " ").split())
        if "my_reward:score" in line:
            cd, _, command = line.partition(" && ")
            return cd.removeprefix("cd "), shlex.split(command)
    raise AssertionError("docs/rl.md has no furlong train command using my_reward:score")


def test_the_documented_example_runs(plugins, tmp_path, monkeypatch) -> None:
    page = (ROOT / "docs" / "rl.md").read_text()
    assert (EXAMPLE / "my_reward.py").read_text() in page  # the page shows the file as it is
    assert (EXAMPLE / "my_task.py").read_text() in page
    where, argv = _documented_command()
    assert argv[:2] == ["furlong", "train"] and ROOT / where == EXAMPLE
    monkeypatch.chdir(EXAMPLE)
    out = tmp_path / "run"
    extra = [f"run.out_dir={out}", "run.progress=false", "run.export_hf=false"]
    assert cli.main(argv[1:] + extra) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:  # my_reward's values are 0, 0.5 and 1
        for key in ("reward:mean", "eval_greedy", "eval_pass1"):
            assert key not in row or 0 <= row[key] <= 1 and not math.isnan(row[key])
    assert "my_reward" in sys.modules
