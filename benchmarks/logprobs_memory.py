"""Peak memory and time of FP32 target log-probs + backward through the LM head.

Measures ``lp.sum().backward()`` (gradients w.r.t. the hidden states and the head weight) for
``T`` rows, vocab ``V`` and hidden size ``H`` (default: the Qwen3-0.6B LM head, fp32) with three
variants:

* ``naive``: full ``[T, V]`` logits, ``log_softmax(logits / temperature)``, gather.
* ``chunked-logits``: full logits from the head, then ``token_logprobs`` (chunks + recompute;
  ``tests/train/logprob_reference.py``).
* ``fused-head``: ``head_logprobs`` (the head is applied per chunk; logits never exist whole).

Each measurement runs in a fresh subprocess (the script re-invokes itself with ``--worker``):
the peak RSS is reset through ``/proc/self/clear_refs``, and the extra peak is ``VmHWM`` minus
the ``VmRSS`` baseline taken after the inputs are built. Variants run alternately for
``--repeats`` rounds; medians per variant are reported, and the time ratio to ``naive`` is
the median of the per-round ratios. Target:
fused-head extra peak <= 15% of naive and time <= 1.3x naive. Linux only.

Run: ``.venv/bin/python benchmarks/logprobs_memory.py`` (about 5 minutes per round on 2 CPU
cores), or ``--quick`` for a one-minute smoke check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from furlong.train.logprobs import head_logprobs  # noqa: E402
from tests.train.logprob_reference import token_logprobs  # noqa: E402

VARIANTS = ("naive", "chunked-logits", "fused-head")
MEMORY_TARGET = 0.15  # fused-head extra peak / naive extra peak
TIME_TARGET = 1.3  # fused-head time / naive time
CHECK_ROWS, CHECK_CHUNK = 64, 16  # correctness check: small slice, several chunks
CHECK_TOLERANCE = 1e-3  # relative max-abs error that counts as "wildly off"


def build_inputs(
    rows: int, vocab: int, hidden_size: int, seed: int
) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    head = nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), dtype=torch.int64)
    return hidden, head, targets


def logprobs(
    variant: str,
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    if variant == "naive":
        logits = head(hidden)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if variant == "chunked-logits":
        logits = head(hidden)
        return token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk_size)
    if variant == "fused-head":
        lp, _ = head_logprobs(hidden, head, targets, temperature=temperature, chunk_size=chunk_size)
        return lp
    raise ValueError(f"unknown variant {variant!r}")


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    """One measurement; prints one JSON line."""
    hidden, head, targets = build_inputs(args.rows, args.vocab, args.hidden, args.seed)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = proc_status_kib("VmRSS")
    start = time.perf_counter()
    lp = logprobs(args.worker, hidden, head, targets, args.temperature, args.chunk_size)
    lp.sum().backward()
    seconds = time.perf_counter() - start
    peak = proc_status_kib("VmHWM")
    extra_gib = (peak - baseline) / 2**20
    print(json.dumps({"variant": args.worker, "extra_gib": extra_gib, "seconds": seconds}))


def check_agreement(args: argparse.Namespace) -> dict[str, float]:
    """Relative max-abs differences between fused-head and naive on a small slice."""
    results: dict[str, tuple[torch.Tensor, ...]] = {}
    for variant in ("naive", "fused-head"):
        hidden, head, targets = build_inputs(CHECK_ROWS, args.vocab, args.hidden, args.seed)
        lp = logprobs(variant, hidden, head, targets, args.temperature, CHECK_CHUNK)
        lp.sum().backward()
        results[variant] = (lp.detach(), hidden.grad, head.weight.grad)
    names = ("logprobs", "hidden.grad", "weight.grad")
    pairs = zip(names, results["naive"], results["fused-head"], strict=True)
    return {n: ((got - ref).abs().max() / ref.abs().max()).item() for n, ref, got in pairs}


def run_worker(variant: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", variant, "--rows", str(args.rows)]
    cmd += ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--seed", str(args.seed)]
    cmd += ["--temperature", str(args.temperature), "--chunk-size", str(args.chunk_size)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rows", "-T", type=int, default=4096)
    parser.add_argument("--vocab", "-V", type=int, default=151_936)
    parser.add_argument("--hidden", "-H", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="T=512, V=32768 smoke check")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.vocab = 512, 32_768
    if args.worker:
        worker(args)
        return

    print(
        f"T={args.rows} V={args.vocab} H={args.hidden} fp32 temperature={args.temperature} "
        f"chunk_size={args.chunk_size} repeats={args.repeats} torch={torch.__version__}"
    )
    diffs = check_agreement(args)
    print(
        f"fused-head vs naive (T={CHECK_ROWS}, chunk {CHECK_CHUNK}), relative max abs diff: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
    )
    if max(diffs.values()) > CHECK_TOLERANCE:
        sys.exit(f"FAIL: fused-head disagrees with naive (tolerance {CHECK_TOLERANCE:.0e})")

    runs: list[dict[str, float]] = []
    with tqdm(total=args.repeats * len(VARIANTS), desc="runs", unit="run") as bar:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                bar.set_postfix_str(variant)
                runs.append(run_worker(variant, args))
                bar.update()

    summary: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        summary[variant] = {
            "extra_gib": statistics.median(r["extra_gib"] for r in mine),
            "seconds": statistics.median(r["seconds"] for r in mine),
        }
    naive = summary["naive"]
    naive_runs = [r for r in runs if r["variant"] == "naive"]
    for variant, s in summary.items():
        mine = [r for r in runs if r["variant"] == variant]
        s["memory_ratio"] = s["extra_gib"] / naive["extra_gib"]
        # Paired per round (runs minutes apart), so host-speed drift between rounds cancels.
        paired = [m["seconds"] / n["seconds"] for m, n in zip(mine, naive_runs, strict=True)]
        s["time_ratio"] = statistics.median(paired)
        s["time_ratios"] = paired

    print("\n| variant | extra peak GiB | time s | memory vs naive | time vs naive (per round) |")
    print("|---|---:|---:|---:|---:|")
    for variant, s in summary.items():
        print(
            f"| {variant} | {s['extra_gib']:.2f} | {s['seconds']:.1f} "
            f"| {s['memory_ratio']:.3f} | {s['time_ratio']:.2f} "
            f"({', '.join(f'{r:.2f}' for r in s['time_ratios'])}) |"
        )
    fused = summary["fused-head"]
    passed = fused["memory_ratio"] <= MEMORY_TARGET and fused["time_ratio"] <= TIME_TARGET
    print(
        f"\n{'PASS' if passed else 'FAIL'}: fused-head memory {fused['memory_ratio']:.3f}x naive "
        f"(target <= {MEMORY_TARGET}), time {fused['time_ratio']:.2f}x naive "
        f"(target <= {TIME_TARGET})"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
        result = {"config": config, "check": diffs, "runs": runs, "summary": summary}
        args.json.write_text(json.dumps(result | {"pass": passed}, indent=2) + "\n")


if __name__ == "__main__":
    main()
