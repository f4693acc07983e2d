"""Service memory over a long RL run: a LoRA RL loop through the official `tinker` SDK against
`furlong serve` (a real subprocess on 127.0.0.1), the way tinker-cookbook's RL recipes drive it:
every step saves a sampler (``save_weights_and_get_sampling_client``), samples a group, trains
on it with ``importance_sampling`` and steps the optimizer. The server's RSS is read from
/proc after every step; the claim is that it stays flat: the end of the run within 10% of its
value at step 20 (the baseline, measured in the same run).

With ``--baseline-checkout DIR`` (e.g. a ``git worktree`` of an older commit) the same loop
first runs against a server started from that checkout, so both curves come from one run.

Writes ``--out``/metrics.jsonl (one line a step and server) and ``--out``/rss.png.

Run: ``.venv/bin/python benchmarks/service_memory.py [--steps 300 --model tiny-qwen3]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
import tinker  # noqa: E402
from tinker import types  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(checkout: str | None) -> list[str]:
    """``furlong`` from this environment, or from another checkout (its package shadows the
    editable install's, whose import hook is taken out)."""
    if checkout is None:
        return [sys.executable, "-m", "furlong"]
    code = (
        f"import sys; sys.path.insert(0, {str(Path(checkout).resolve())!r}); "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
        "from furlong.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code]


def start_server(model: str, state_dir: str, checkout: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [*server_command(checkout), "serve", "--port", str(port)]
    cmd += ["--base-model", model, "--state-dir", state_dir]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("furlong serve did not start")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float) -> types.Datum:
    tokens = prompt + list(seq.tokens)
    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * pad + list(seq.logprobs),
            "advantages": [0.0] * pad + [advantage] * len(seq.tokens),
        },
    )


def run_loop(args: argparse.Namespace, checkout: str | None, label: str) -> list[dict]:
    """The RL loop against a fresh server; one row a step (its RSS and elapsed time)."""
    with tempfile.TemporaryDirectory() as state:
        proc, url = start_server(args.model, state, checkout)
        try:
            sdk = tinker.ServiceClient(base_url=url, api_key="tml-bench")
            training = sdk.create_lora_training_client(args.model, rank=args.rank).result()
            tokenizer = training.get_tokenizer()
            prompt = tokenizer("Reverse the digits of 4821:")["input_ids"]
            params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
            rows = []
            start = time.perf_counter()
            for step in tqdm(range(1, args.steps + 1), desc=f"RL steps ({label})", unit="step"):
                sampler = training.save_weights_and_get_sampling_client().result()
                result = sampler.sample(
                    types.ModelInput.from_ints(prompt), args.group, params
                ).result()
                lengths = [len(s.tokens) for s in result.sequences]
                mean = sum(lengths) / len(lengths)
                data = [rl_datum(prompt, s, len(s.tokens) - mean) for s in result.sequences]
                training.forward_backward(data, "importance_sampling").result()
                training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                rows.append(
                    {
                        "server": label,
                        "step": step,
                        "rss_mb": rss_mb(proc.pid),
                        "elapsed_s": time.perf_counter() - start,
                    }
                )
            sdk.close("success").result()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def summary(rows: list[dict], args: argparse.Namespace) -> str:
    base = rows[args.baseline_step - 1]
    end = rows[-1]
    peak = max(r["rss_mb"] for r in rows[args.baseline_step - 1 :])
    per_step = (end["elapsed_s"] - base["elapsed_s"]) / (args.steps - args.baseline_step)
    cells = [
        rows[0]["server"],
        f"{base['rss_mb']:.1f}",
        f"{end['rss_mb']:.1f}",
        f"{end['rss_mb'] / base['rss_mb']:.3f}",
        f"{peak / base['rss_mb']:.3f}",
        f"{(end['rss_mb'] - base['rss_mb']) * 1024 / (args.steps - args.baseline_step):.0f}",
        f"{per_step:.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--group", type=int, default=8, help="samples per step")
    parser.add_argument("--tokens", type=int, default=16, help="max tokens per sample")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--baseline-step", type=int, default=20)
    parser.add_argument("--baseline-checkout", help="also run a server from this checkout first")
    parser.add_argument("--out", default="runs/service_memory")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = []
    if args.baseline_checkout:
        runs.append(run_loop(args, args.baseline_checkout, "baseline"))
    runs.append(run_loop(args, None, "this checkout"))
    with open(out / "metrics.jsonl", "w") as log:
        for row in (r for rows in runs for r in rows):
            log.write(json.dumps(row) + "\n")

    print(f"\n{args.model}, LoRA rank {args.rank}, {args.steps} steps of {args.group} samples")
    print(
        f"| server | RSS at step {args.baseline_step} MB | RSS at the end MB | end / step "
        f"{args.baseline_step} | peak / step {args.baseline_step} | KB per step | s/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rows in runs:
        print(summary(rows, args))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for rows in runs:
        ax.plot([r["step"] for r in rows], [r["rss_mb"] for r in rows], label=rows[0]["server"])
    base = runs[-1][args.baseline_step - 1]["rss_mb"]
    ax.axhline(base * 1.1, color="grey", linestyle="--", label=f"step {args.baseline_step} + 10%")
    ax.set_xlabel("RL step (save sampler, sample, train)")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title(f"furlong serve memory, {args.model} LoRA RL through the tinker SDK")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=120)


if __name__ == "__main__":
    main()
