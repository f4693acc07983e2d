"""RL config: TOML + CLI overrides, types, and validation messages that say what to change;
tasks and verifiers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from furlong.errors import InputError
from furlong.rl.config import RLConfig, load_config, to_toml
from furlong.rl.tasks import Problem, addition, build_task, exact_number, jsonl
from tools import config_reference as config_doc


def test_toml_then_overrides(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\nname = "tiny-qwen3"\n'
        "[rollout]\ngroup_size = 4\nmax_tokens = 6\n"
        '[algo]\nobjective = "ppo"\nclip_low = 0.8\nlearning_rate = 1e-3\n'
        '[colocate]\nenabled = true\noffload_rollout_level = ["kv_cache"]\n'
    )
    config = load_config(
        path, ["rollout.group_size=2", "algo.clip_high=2", "run.out_dir=/tmp/x", "algo.lam=1"]
    )
    assert config.model.name == "tiny-qwen3"
    assert config.rollout.group_size == 2 and config.rollout.max_tokens == 6
    assert config.algo.clip_high == 2.0 and isinstance(config.algo.clip_high, float)
    assert config.algo.lam == 1.0 and config.run.out_dir == "/tmp/x"
    assert config.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    assert config.colocate.offload_rollout_level == ["kv_cache"]
    assert load_config() == RLConfig()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.group_size=1"], "GRPO compares samples of one prompt"),
        (["algo.minibatches=3"], "does not divide the batch of 128"),
        (["algo.clip_low=0.5"], "only ppo, cispo, gspo clip"),
        (["algo.dro_beta=0.1"], "only for algo.objective = 'dro'"),
        (
            ["algo.advantage=gae", "colocate.enabled=true", "colocate.memory_peak_device=gpu"],
            "critic",
        ),
        (["critic.warmup_steps=2"], "needs the critic"),
        (["algo.objective=cross_entropy"], "algo.objective: unknown 'cross_entropy'"),
        (["algo.normalize=batch"], "algo.normalize"),
        (["task.reward=nope"], "task.reward: unknown 'nope'"),
        (["rollout.group_size=two"], "rollout.group_size: expected int, got 'two'"),
        (["rollout.top_p=true"], "rollout.top_p: expected float"),
        (["algo.clipp=1"], "algo.clipp: unknown field"),
        (["optim.lr=1"], r"unknown group \[optim\]"),
        (["group_size=2"], r"overrides\[0\]: 'group_size=2' is not group.field=value"),
        (["algo.gamma=1.5"], "algo.gamma and algo.lam"),
        (["model.device=tpu"], "model.device: 'tpu'; expected cpu, cuda or cuda:N"),
        (["model.dtype=float16"], "model.dtype: unknown 'float16'"),
        (["optimizer.state_store=disk"], "optimizer.disk_dir: required"),
        (["optimizer.kind=sgd"], "optimizer.kind: 'sgd' is not one of"),
        (["warmup.decoy_share=1.0"], r"warmup.decoy_share: must be in \[0, 1\)"),
    ],
)
def test_validation_says_what_to_change(overrides, match) -> None:
    with pytest.raises(InputError, match=match):
        load_config(None, overrides)


# the start and end of each message, written out; the list between is every valid name
SPELLING = [
    (
        ["rollout.grup_size=4"],
        r"^rollout\.grup_size: unknown field; expected one of \['engine', 'group_size', .*\]; "
        r"did you mean 'group_size'\?$",
    ),
    (  # an abbreviation: the name it begins
        ["algo.learning=1e-3"],
        r"^algo\.learning: unknown field; expected one of \[.*\]; did you mean 'learning_rate'\?$",
    ),
    (
        ["optim.lr=1"],
        r"^config: unknown group \[optim\]; expected one of \['model', .*\]; "
        r"did you mean 'optimizer'\?$",
    ),
    (
        ["algo.objective=ppp"],
        r"^algo\.objective: unknown 'ppp'; expected one of \[.*\]; did you mean 'ppo'\?$",
    ),
    (["rollout.zzzzzz=1"], r"^rollout\.zzzzzz: unknown field; expected one of \[[^;]*\]$"),
]


@pytest.mark.parametrize("overrides, message", SPELLING)
def test_a_mistyped_name_says_the_closest_right_one(overrides, message) -> None:
    with pytest.raises(InputError, match=message):
        load_config(None, overrides)


def test_a_mistyped_name_in_the_toml_file_says_the_closest_too(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[rollout]\ngroup_sise = 4\n")
    with pytest.raises(InputError, match=r"^rollout\.group_sise: .*; did you mean 'group_size'\?$"):
        load_config(path)


def test_gae_replaces_the_group_requirement() -> None:
    config = load_config(None, ["algo.advantage=gae", "rollout.group_size=1"])
    assert config.uses_critic


def test_addition_split_is_stable_and_disjoint() -> None:
    train, held = addition(9, 9)
    assert len(train) + len(held) == 100 and 10 <= len(held) <= 30
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert addition(9, 9) == (train, held)
    assert Problem("What is 3 + 4?", "7") in train + held


def test_exact_number_reads_the_first_number() -> None:
    problem = Problem("What is 3 + 4?", "7")
    assert exact_number("7", problem) == 1.0
    assert exact_number(" 7 apples", problem) == 1.0
    assert exact_number("17", problem) == 0.0
    assert exact_number("no idea", problem) == 0.0
    assert exact_number("6, no 7", problem) == 0.0


def test_jsonl_task(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(12)]
    rows[0]["split"] = "eval"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = build_task("jsonl", "exact_match", str(path))
    assert sorted(p.prompt for p in task.eval) == ["q0", "q9"]  # explicit split, every 10th line
    assert len(task.train) == 10
    path.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(InputError, match="line 2"):
        jsonl(path)
    with pytest.raises(InputError, match="task.path: required"):
        build_task("jsonl", "exact_match")


def test_the_docs_config_reference_is_up_to_date() -> None:
    """docs/rl.md's reference is generated from the config classes; regenerate it with
    ``python -m tools.config_reference docs/rl.md`` when a field changes."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    assert config_doc.reference() in page
    for group in dataclasses.fields(RLConfig):
        for f in dataclasses.fields(type(group.default_factory())):
            assert f"| `{f.name}` |" in page, f"{group.name}.{f.name}"
            assert config_doc.field_comments(type(group.default_factory()))[f.name], (
                f"{group.name}.{f.name} has no comment to document it"
            )


def test_to_toml_round_trips(tmp_path) -> None:
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            'task.name="reverse"',
            "algo.advantage=gae",
            "algo.objective=ppo",
            "algo.clip_low=0.7",
            "critic.value_clip=0.5",
            'colocate.offload_rollout_level=["kv_cache"]',
            "colocate.enabled=true",
            "run.out_dir=runs/x y",
        ],
    )
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert load_config(path) == config
    assert load_config(path) != RLConfig()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(InputError, match="model.device: 'cuda', but torch sees no CUDA device"):
        load_config(None, ["model.device=cuda"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("colocate.memory_peak_device=tpu", r"colocate\.memory_peak_device: 'tpu' is not one of"),
        ('colocate.offload_rollout_level=["weights"]', r"colocate\.offload_rollout_level: unknown"),
    ],
)
def test_colocation_values_are_checked_while_it_is_off(override: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        load_config(None, [override])  # colocate.enabled stays false


def test_rollout_engine_choice_is_checked_with_the_scale_group() -> None:
    with pytest.raises(InputError, match=r'rollout\.engine: "ray" runs the engines as Ray actors'):
        load_config(None, ["rollout.engine=ray"])
    config = load_config(None, ["rollout.engine=ray", 'scale.ray="local"'])
    assert config.rollout.engine == "ray" and config.scale.ray == "local"
    with pytest.raises(InputError, match=r"rollout\.engine: 'sglang' with \[scale\]"):
        load_config(
            None,
            [
                "rollout.engine=sglang",
                'rollout.urls=["http://127.0.0.1:1"]',
                "scale.trainer_ranks=2",
            ],
        )
    with pytest.raises(InputError, match=r"rollout\.urls: only used with"):
        load_config(None, ['rollout.urls=["http://127.0.0.1:1"]'])


def test_objective_config_is_checked_against_the_registry(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[algo]\nobjective = "dro"\n[algo.objective_config]\nbeta = 0.1\n')
    assert load_config(path).loss_fn_config == {"beta": 0.1}
    high = "algo.objective_config.clip_high_threshold=2"
    config = load_config(None, ["algo.objective=ppo", high])
    assert config.algo.objective_config == {"clip_high_threshold": 2.0}
    assert load_config(None, ["algo.objective=cispo", "algo.clip_low=0.1"]).loss_fn_config == {
        "clip_low_threshold": 0.1
    }
    (tmp_path / "config.toml").write_text(to_toml(config))
    assert load_config(tmp_path / "config.toml") == config
    for overrides, match in [
        (["algo.objective=gspo", "algo.objective_config.beta=1"], r"unknown key 'beta' for 'gspo'"),
        (["algo.objective=ppo", "algo.objective_config.clip_low_threshold=true"], "expected float"),
        (["algo.objective=ppo", "algo.clip_low=2"], "clip_low_threshold <= clip_high_threshold"),
        (["algo.objective=dro", "algo.dro_beta=1", "algo.objective_config.beta=1"], "also set"),
        (["algo.objective_config=3"], r"algo.objective_config: expected dict\[str, float\]"),
    ]:
        with pytest.raises(InputError, match=match):
            load_config(None, overrides)
