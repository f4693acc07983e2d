"""The Tinker service's training speed through the official SDK: furlong serve (in process, on
127.0.0.1) against SkyRL's Tinker server when one is running, alternating round by round on
the same workload, and furlong's achieved model GFLOP/s beside this machine's measured fp32
GEMM peak (benchmarks/flops.py) in the same run.

Workloads (cross_entropy, LoRA rank 32, random tokens, weights 1):
- ``shared``: 64 datums x 128 tokens on SkyRL's benchmark model (Qwen3, vocab 4096, hidden 64,
  2 layers; ``../shared/bench/skyrl/make_tiny.py`` builds it, ``--model-dir`` points at it; the
  same architecture is built here when it is not given). Target: >= 2x SkyRL's speed.
- ``small``: 64 datums x 512 tokens on small-qwen3. Target: >= 60% of the fp32 peak.

SkyRL (optional): start it as ``../shared/bench/skyrl/README.md`` says, on the same model dir,
and pass ``--sky-url http://127.0.0.1:9101``.

Run: ``.venv/bin/python benchmarks/tinker_vs_skyrl.py [--rounds 5] [--sky-url URL]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
import torch  # noqa: E402
from flops import Shape, gemm_peak, train_flops  # noqa: E402
from tinker import types  # noqa: E402

from furlong.precision import describe_bf16  # noqa: E402
from furlong.server.app import create_app  # noqa: E402
from furlong.server.service import Service, ServiceConfig  # noqa: E402
from furlong.serving import background_server  # noqa: E402

RANK = 32


def shared_model(directory: Path) -> Path:
    """SkyRL's benchmark architecture (make_tiny.py) with random weights and furlong's
    tiny-qwen3 tokenizer: the model's shapes are what the timing depends on."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from furlong.models.loading import load_tokenizer

    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        head_dim=16,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    load_tokenizer("tiny-qwen3").save_pretrained(directory)
    return directory


def batch(n: int, length: int, vocab: int, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(1, vocab, size=length + 1)
        inputs = {
            "target_tokens": types.TensorData.from_numpy(t[1:].astype(np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(length, np.float32)),
        }
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1].tolist()), loss_fn_inputs=inputs
            )
        )
    return out


def timed(client: tinker.TrainingClient, data: list[types.Datum]) -> float:
    start = time.perf_counter()
    client.forward_backward(data, "cross_entropy").result()
    took = time.perf_counter() - start
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, help="SkyRL's benchmark model (make_tiny.py)")
    parser.add_argument("--sky-url", help="a running SkyRL Tinker server on the same model")
    parser.add_argument("--sky-model", default="tiny-qwen3", help="its base_model name")
    args = parser.parse_args()

    peak = gemm_peak()
    print(f"fp32 GEMM peak, {torch.get_num_threads()} threads: {peak:.1f} GFLOP/s")
    print(f"fast bf16 matmul path: {describe_bf16()}")
    scratch = Path(tempfile.mkdtemp(prefix="furlong-bench-"))
    model_dir = args.model_dir or shared_model(scratch / "shared")
    config = ServiceConfig({"shared": str(model_dir), "small": "small-qwen3"}, scratch / "state")
    service = Service(config)
    with background_server(create_app(service)) as url:
        ours = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        sides = {"furlong": ours.create_lora_training_client("shared", rank=RANK).result()}
        if args.sky_url:
            sky = tinker.ServiceClient(base_url=args.sky_url, api_key="tml-bench")
            sides["skyrl"] = sky.create_lora_training_client(args.sky_model, rank=RANK).result()
        small = ours.create_lora_training_client("small", rank=RANK).result()
        # the bases the service loaded for those clients
        shapes = {name: Shape.of(service.pool.base(name)[0].config) for name in ("shared", "small")}
        data = {"shared": batch(64, 128, 4096), "small": batch(64, 512, 768)}
        for name, client in sides.items():  # first calls: compiles, page faults, caches
            for _ in range(2):
                timed(client, data["shared"])
            print(f"warmed up {name}")
        timed(small, data["small"])

        times: dict[str, list[float]] = {name: [] for name in [*sides, "small"]}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            line = [f"round {r + 1}:"]
            for name in order:
                times[name].append(timed(sides[name], data["shared"]))
                line.append(f"{name} {times[name][-1]:.3f} s")
            times["small"].append(timed(small, data["small"]))
            line.append(f"small-qwen3 64x512 {times['small'][-1]:.3f} s")
            print("  ".join(line), flush=True)
    peak = max(peak, gemm_peak())  # the better of before and after

    print()
    for name, workload, length in (("furlong", "shared", 128), ("small", "small", 512)):
        flops = train_flops(shapes[workload], [length] * 64, lora_rank=RANK)
        per_round = [flops / t / 1e9 for t in times[name]]
        median = statistics.median(per_round)
        print(
            f"{workload} 64x{length}: median {statistics.median(times[name]):.3f} s, "
            f"{median:.1f} model GFLOP/s = {100 * median / peak:.0f}% of the fp32 peak "
            f"(per round: {', '.join(f'{x:.1f}' for x in per_round)})"
        )
    if "skyrl" in times:
        ratios = [s / f for s, f in zip(times["skyrl"], times["furlong"], strict=True)]
        print(
            f"furlong speed / SkyRL speed per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.2f}x (target >= 2x)"
        )
    else:
        print("SkyRL: not measured (no --sky-url)")


if __name__ == "__main__":
    main()
