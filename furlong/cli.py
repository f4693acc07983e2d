"""`furlong` command line: demo | init-model | rollout-server."""

from __future__ import annotations

import argparse
import sys

from furlong.models.presets import PRESETS


def _demo(args: argparse.Namespace) -> int:
    from furlong.demo import DemoConfig, run_demo

    run_demo(DemoConfig(model=args.model, steps=args.steps, out_dir=args.out, seed=args.seed))
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from furlong.models.loading import save_hf_dir
    from furlong.models.presets import build_preset

    model, tokenizer = build_preset(args.preset, seed=args.seed)
    out = save_hf_dir(model, tokenizer, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.preset} ({n:,} parameters, seed {args.seed}) to {out}")
    return 0


def _rollout_server(args: argparse.Namespace) -> int:
    from furlong.rollout.server import serve

    serve(args.model, args.host, args.port, args.max_running, args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="furlong", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny offline model on CPU and show the loss fall")
    demo.add_argument("--model", default="small-qwen3", help="preset name or local HF directory")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="metrics.jsonl and loss.png go here")
    demo.set_defaults(func=_demo)

    init = sub.add_parser("init-model", help="write a seeded tiny preset as an HF directory")
    init.add_argument("--preset", required=True, choices=sorted(PRESETS))
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=_init_model)

    rollout = sub.add_parser(
        "rollout-server", help="serve the embedded rollout engine over SGLang's HTTP protocol"
    )
    rollout.add_argument("--model", default="tiny-qwen3", help="preset name or local HF dir")
    rollout.add_argument("--host", default="127.0.0.1")
    rollout.add_argument("--port", type=int, default=30000)
    rollout.add_argument("--max-running", type=int, default=32, help="batch slots")
    rollout.add_argument("--seed", type=int, default=0, help="weights seed for a preset")
    rollout.set_defaults(func=_rollout_server)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
