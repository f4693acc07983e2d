"""Run by tests/rl/test_ray.py (in a loopback-only network namespace where available): start
a Ray cluster on 127.0.0.1, run a few RL steps with 2 trainer ranks and 1 rollout engine as
Ray actors, and kill the engine actor while a generate call is in flight. The run writes into
``argv[2]``; the metrics rows and what happened go to ``argv[1]`` as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ray

from furlong.rl import ray_rollout, tasks
from furlong.rl.config import load_config
from furlong.rl.loop import train
from furlong.rl.scale import ScaleOut
from tests.train.helpers import short_text

KILL_AT_GENERATE = 3  # 1: evaluation before RL, 2: step 1, 3: step 2
killed: list[str] = []


def kill_mid_call(original):
    """Kill the engine's process right after a generate call was sent to it (a crash)."""
    calls = {"generate": 0}

    def get(self, j, ref, method, *args):
        if method == "generate":
            calls["generate"] += 1
            if calls["generate"] == KILL_AT_GENERATE:
                name = next(
                    a["name"]
                    for a in ray.util.list_named_actors(True)
                    if a["name"].startswith("furlong-rollout-")
                )
                ray.kill(ray.get_actor(name), no_restart=False)
                killed.append(name)
        return original(self, j, ref, method, *args)

    return get


def main(out_path: str, out_dir: str) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False)
    tasks.REWARDS["short_text"] = short_text
    ray_rollout.RayRollout._get = kill_mid_call(ray_rollout.RayRollout._get)
    config = load_config(
        None,
        [
            "model.name=tiny-qwen3",
            "task.reward=short_text",
            "task.eval_size=4",
            "task.eval_samples=0",
            "rollout.prompts_per_step=2",
            "rollout.group_size=3",
            "rollout.max_tokens=5",
            "run.steps=3",
            "run.eval_every=3",
            "run.progress=false",
            f"run.out_dir={out_dir}",
        ],
    )
    summary = train(config, ScaleOut(trainer_ranks=2, ray="local"))
    lines = Path(out_dir, "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    result = {
        "rows": rows,
        "killed": killed,
        "policy": str(summary.hf_dir),
        "node_ip": ray.util.get_node_ip_address(),
    }
    ray.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
