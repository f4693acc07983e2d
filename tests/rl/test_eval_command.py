"""``furlong eval`` and ``samples.jsonl``: a finished run, its checkpoint and a preset scored
on the run's task; the scores match the loop's own last evaluation (one code path) and the
replies they come from; a run's samples print back."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from furlong import cli
from furlong.metrics import read_metrics
from furlong.rl.samples_log import read_samples
from furlong.rl.tasks import exact_match

pytestmark = pytest.mark.usefixtures("one_thread")


def short_run(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "model.name=tiny-qwen3",
        "task.name=reverse",
        "task.max_a=2",
        "task.reward=exact_match",
        "task.eval_size=6",
        "task.eval_samples=2",
        "task.eval_pass_k=2",
        "warmup.steps=30",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_tokens=4",
        "run.steps=2",
        "run.eval_every=2",
        "run.samples_every=1",
        "run.save_every=2",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.out_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "rl"
    assert cli.main(short_run(out)) == 0
    return out


def test_samples_jsonl_holds_every_evaluated_and_sampled_reply(finished) -> None:
    rows = list(read_samples(finished / "samples.jsonl"))
    by = {(r["step"], r["mode"]): 0 for r in rows}
    for r in rows:
        by[(r["step"], r["mode"])] += 1
    # evaluations at steps 0 and 2: 6 greedy + 6 x 2 sampled; the steps' 2 x 2 trained on
    assert by == {
        (0, "greedy"): 6,
        (0, "sampled"): 12,
        (1, "train"): 4,
        (2, "train"): 4,
        (2, "greedy"): 6,
        (2, "sampled"): 12,
    }
    metrics = {r["step"]: r for r in read_metrics(finished / "metrics.jsonl")}
    for step in (0, 2):
        greedy = [r for r in rows if r["step"] == step and r["mode"] == "greedy"]
        assert metrics[step]["eval_greedy"] == pytest.approx(sum(r["correct"] for r in greedy) / 6)
    for r in rows:  # each verdict is the verifier's on the recorded completion
        assert r["correct"] == exact_match(r["completion"], _problem(r))
        assert r["reward"] == r["correct"]  # no format term in this run


def _problem(row: dict):
    from furlong.rl.tasks import Problem

    return Problem(row["prompt"], row["reference"])


def test_eval_of_the_run_repeats_the_loops_last_evaluation(finished, tmp_path, capsys) -> None:
    last = read_metrics(finished / "metrics.jsonl")[-1]
    for model in (finished, finished / "checkpoints" / "step-000002"):
        report = tmp_path / "eval.json"
        assert cli.main(["eval", str(model), f"--out={report}"]) == 0
        data = json.loads(report.read_text())
        (scored,) = data["models"]
        for key in ("eval_greedy", "eval_solved", "eval_pass1", "eval_pass@2", "eval_stopped"):
            assert scored[key] == last[key], (model, key)
        greedy = [r for r in scored["replies"] if r["mode"] == "greedy"]
        assert scored["eval_greedy"] == sum(r["correct"] for r in greedy) / len(greedy)
        assert data["task"]["name"] == "reverse"
    printed = capsys.readouterr().out
    assert "| model | greedy | solved | stopped | pass1 | pass@2 | seconds |" in printed


def test_compare_puts_two_models_side_by_side(finished, tmp_path, capsys) -> None:
    report = tmp_path / "compare.json"
    argv = [
        "eval",
        "--compare",
        "tiny-qwen3",
        str(finished),
        f"--config={finished / 'config.toml'}",
    ]
    assert cli.main([*argv, "--samples=0", "--examples=2", f"--out={report}"]) == 0
    printed = capsys.readouterr().out
    names = [m["model"] for m in json.loads(report.read_text())["models"]]
    assert names == ["tiny-qwen3", str(finished)]
    assert printed.count("tiny-qwen3:") == 2 and printed.count(f"{finished}:") == 2
    assert "(answer: " in printed


def test_show_prints_a_runs_replies(finished, capsys) -> None:
    assert cli.main(["eval", str(finished), "--show", "--mode=greedy", "--limit=3"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{finished / 'samples.jsonl'}: step 2, 6 replies")
    assert printed.count("- [greedy]") == 3
    assert cli.main(["eval", str(finished), "--show", "--step=1"]) == 0
    assert "step 1, 4 replies" in capsys.readouterr().out


def test_a_resumed_run_keeps_the_samples_up_to_its_checkpoint(finished, tmp_path) -> None:
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    with (run / "samples.jsonl").open("a") as f:  # a crash after the checkpoint wrote these
        f.write(json.dumps({"step": 3, "mode": "train"}) + "\n" + '{"step": 3, "mo')
    assert cli.main(["train", "--resume", str(run), "run.steps=3", "run.save_every=0"]) == 0
    steps = [r["step"] for r in read_samples(run / "samples.jsonl")]
    assert steps.count(3) == 4 + 6 + 12  # step 3 once: trained on, then its final evaluation
    assert sorted(set(steps)) == [0, 1, 2, 3]


def test_a_plugin_task_gets_its_args_and_its_problems_metadata_reaches_the_reward(
    tmp_path, monkeypatch
) -> None:
    (tmp_path / "meta_task.py").write_text(
        textwrap.dedent(
            """
            from furlong.rl.tasks import Problem

            def problems(*, count, word):
                made = [Problem(f"Say {word} {i}", word, metadata={"i": i}) for i in range(count)]
                return made[:-2], made[-2:]

            def reward(response, problem):
                return float(problem.metadata["i"])
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from furlong.errors import InputError
    from furlong.rl.config import load_config
    from furlong.rl.task_sources import make_task

    over = ["task.name=meta_task:problems", "task.reward=meta_task:reward"]
    over.append("task.constant_check=off")  # its reward pays any reply: by design here
    config = load_config(None, [*over, "task.args.count=5", "task.args.word=hi"])
    task = make_task(config.task)
    assert [p.prompt for p in task.train] == ["Say hi 0", "Say hi 1", "Say hi 2"]
    assert [task.score("x", p).reward for p in task.eval] == [3.0, 4.0]
    with pytest.raises(InputError, match="task.args: meta_task:problems cannot take"):
        make_task(load_config(None, [*over, "task.args.count=5"]).task)  # word is missing
    sys.modules.pop("meta_task", None)
