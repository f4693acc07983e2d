"""Service overhead: forward_backward on a 64-datum batch through the official `tinker` SDK and
`furlong serve` (in-process uvicorn on 127.0.0.1) vs the same call on the same LoRA model in
process (`TrainingModel.forward_backward`, run on the service's compute thread so both use
the same intra-op thread pool). Both sides alternate over ``--repeats`` rounds; the
median of per-round time ratios is reported. Target: <= 1.15x.

Run: ``.venv/bin/python benchmarks/server_overhead.py [--datums 64 --length 128]``
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
os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from furlong.server.app import create_app  # noqa: E402
from furlong.server.models import LoraSpec  # noqa: E402
from furlong.server.service import Service, ServiceConfig  # noqa: E402
from furlong.serving import background_server  # noqa: E402
from furlong.types import Datum  # noqa: E402


def batch(n: int, length: int, seed: int = 0) -> tuple[list[types.Datum], list[Datum]]:
    rng = np.random.default_rng(seed)
    sdk, ours = [], []
    for _ in range(n):
        tokens = rng.integers(3, 700, size=length + 1)
        inputs = {
            "target_tokens": tokens[1:].astype(np.int64),
            "logprobs": -rng.uniform(3, 9, length).astype(np.float32),
            "advantages": rng.normal(0, 1, length).astype(np.float32),
        }
        sdk.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
            )
        )
        ours.append(Datum(tokens[:-1], inputs))
    return sdk, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="small-qwen3")
    parser.add_argument("--datums", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sdk_data, data = batch(args.datums, args.length)
    config = ServiceConfig({"base": args.model}, Path(tempfile.mkdtemp()) / "state")
    service = Service(config)
    local = service.pool.create("local:train:0", "base", LoraSpec(rank=8))
    with background_server(create_app(service)) as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        training = client.create_lora_training_client("base", rank=8).result()
        training.forward_backward(sdk_data[:2], "importance_sampling").result()  # warm-up
        local.forward_backward(data[:2], "importance_sampling", None, False)
        print(
            f"{args.model}: {args.datums} datums x {args.length} tokens, importance_sampling, "
            "LoRA rank 8"
        )
        ratios = []
        for _ in range(args.repeats):
            start = time.perf_counter()  # through the service's compute lane, like a request
            service.lane.submit(
                "local", local.forward_backward, data, "importance_sampling", None, False
            ).result()
            direct = time.perf_counter() - start
            start = time.perf_counter()
            training.forward_backward(sdk_data, "importance_sampling").result()
            served = time.perf_counter() - start
            ratios.append(served / direct)
            print(
                f"in process {direct:6.3f} s   through the SDK {served:6.3f} s   "
                f"ratio {served / direct:.3f}"
            )
    ratio = statistics.median(ratios)
    print(f"\n{'PASS' if ratio <= 1.15 else 'FAIL'}: median ratio {ratio:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
