"""Sampling-mask size (CSR vs a dense boolean [T, V] mask) and codec throughput.

Generates with top-p 0.9 on an offline model, records the kept sets, and reports the CSR
bytes (int32 ids + int64 offsets) against a dense ``[T, V]`` bool mask for the same
positions, then the codec's encode + decode rate for those samples with masks opted in.

Run: ``.venv/bin/python benchmarks/sampling_mask_bytes.py [--model tiny-qwen3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from furlong.models import load_model  # noqa: E402
from furlong.rollout.codec import DEFAULT_FIELDS, decode_samples, encode_samples  # noqa: E402
from furlong.rollout.engine import EmbeddedEngine  # noqa: E402
from furlong.rollout.sample import Sample, append_sampled  # noqa: E402
from furlong.rollout.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    engine = EmbeddedEngine(model, tokenizer, max_running=args.requests)
    prompts = [tokenizer(f"Question {i}: tell me a story.")["input_ids"] for i in range(16)]
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            top_p=args.top_p,
            seed=i,
            stop_token_ids=(),
            return_sampling_mask=True,
        )
        for i in range(args.requests)
    ]
    results = engine.generate(prompts[: args.requests], params)
    positions = sum(len(r.output_ids) for r in results)
    kept = [r.sampling_mask.tensors() for r in results]
    csr = sum(ids.numel() * 4 + offsets.numel() * 8 for ids, offsets in kept)
    dense = positions * engine.vocab_size  # one byte per bool
    mean_kept = sum(ids.numel() for ids, _ in kept) / positions
    print(
        f"{args.model}: V={engine.vocab_size}, top_p={args.top_p}, {positions} positions, "
        f"mean kept set {mean_kept:.1f} ids"
    )
    print(
        f"CSR {csr / 1024:.1f} KiB vs dense bool {dense / 1024:.1f} KiB: {dense / csr:.1f}x smaller"
    )

    samples = [
        append_sampled(
            Sample.from_prompt(r.prompt_ids), r.output_ids, r.output_logprobs, r.sampling_mask
        )
        for r in results
    ]
    fields = (*DEFAULT_FIELDS, "sampling_mask")
    payload = encode_samples(samples, fields)
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        decode_samples(encode_samples(samples, fields), fields)
        rates.append(len(payload) / (time.perf_counter() - start) / 2**20)
    print(
        f"codec encode+decode: payload {len(payload) / 1024:.1f} KiB, "
        f"median {statistics.median(rates):.1f} MB/s over 5 runs"
    )


if __name__ == "__main__":
    main()
