"""Run by tests/rl/test_ray.py: one MoE rollout engine as a Ray actor on 127.0.0.1, its
results through the rollout codec. Writes what the driver saw to ``argv[1]`` as JSON."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import ray

from furlong.errors import InputError
from furlong.rl.ray_rollout import EngineSpec, RayRollout, start_engines
from furlong.rollout.codec import DEFAULT_FIELDS, decode_results, encode_results
from furlong.rollout.sampling import SamplingParams

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
PLAIN = SamplingParams(max_tokens=4, top_k=5, seed=3)
RICH = SamplingParams(
    max_tokens=4, top_k=5, seed=3, return_sampling_mask=True, return_routed_experts=True
)


def main(out_path: str) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False)
    (engine,) = start_engines(EngineSpec("tiny-qwen3-moe"), [None], [{"CPU": 1}])
    rollout = RayRollout([engine])
    payload = ray.get(engine.call.remote("generate", PROMPTS, [PLAIN] * 2, DEFAULT_FIELDS))
    plain = decode_results(payload)
    rich = rollout.generate(PROMPTS, RICH)  # the params opt in
    try:
        RayRollout([engine], fields=DEFAULT_FIELDS).generate(PROMPTS, RICH)
        refused = ""
    except InputError as exc:
        refused = str(exc)
    same_ids = [replace(r, request_id=p.request_id) for r, p in zip(rich, plain, strict=True)]
    result = {
        "node_ip": ray.util.get_node_ip_address(),
        # the same draws: the opt-in fields add nothing to the default payload
        "default_bytes_equal": payload == encode_results(same_ids, DEFAULT_FIELDS),
        "plain_optional": [[r.sampling_mask, r.routed_experts] for r in plain] == [[None] * 2] * 2,
        "rich": [
            {
                "tokens": len(r.prompt_ids) + len(r.output_ids),
                "output_ids": r.output_ids,
                "mask_rows": r.sampling_mask.to_lists(),
                "routes": list(r.routed_experts.shape),
            }
            for r in rich
        ],
        "refused": refused,
    }
    ray.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
