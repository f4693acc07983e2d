"""`furlong` command line: demo | train | init-model | rollout-server | session-server | serve."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from furlong.errors import InputError
from furlong.models.pretrained import model_names


def _demo(args: argparse.Namespace) -> int:
    from furlong.demo import demo_config, run_demo

    run_demo(demo_config(args.algo, args.out, f"run.seed={args.seed}", *args.overrides))
    return 0


def train_config(
    args: argparse.Namespace, config_file: str | None = None, first: tuple[str, ...] = ()
) -> Any:
    """The RLConfig a `furlong train` command line means: the file, then the overrides (after
    ``first``), then the scale-out flags (as ``scale.*`` overrides, so they are validated like
    the rest)."""
    from furlong.rl.config import load_config
    from furlong.rl.scale import ScaleOut

    config, overrides = args.config, [*first, *args.overrides]
    if config is not None and "=" in config and not config.endswith(".toml"):
        config, overrides = None, [*first, config, *args.overrides]  # only overrides were given
    flags = ScaleOut(args.trainer_ranks, args.ray, args.rollout_engines, args.ray_colocate)
    for name, value in dataclasses.asdict(flags).items():  # flags beat the file, as overrides
        if value != getattr(ScaleOut(), name):
            overrides.append(f"scale.{name}={json.dumps(value)}")
    return load_config(config_file or config, overrides)


def _train(args: argparse.Namespace) -> int:
    from furlong.rl.loop import train

    if args.resume is None:
        summary = train(train_config(args))
    else:
        summary = train(_resume_config(args), resume=args.resume)
    print(f"held-out before RL: {summary.before}")
    print(f"held-out after RL:  {summary.after} ({summary.seconds:.0f} s)")
    print(f"metrics and curves in {summary.out_dir}; policy: {summary.hf_dir}")
    return 0


def _resume_config(args: argparse.Namespace) -> Any:
    """Without a TOML file: the checkpoint's own config, writing on into its run directory;
    the overrides apply on top (e.g. more ``run.steps``)."""
    from furlong.rl.resume import find_checkpoint

    if args.config is not None and args.config.endswith(".toml"):
        return train_config(args)
    saved = find_checkpoint(args.resume)
    out = f"run.out_dir={json.dumps(str(saved.run_dir))}"
    return train_config(args, str(saved.path / "config.toml"), first=(out,))


def _init_model(args: argparse.Namespace) -> int:
    from furlong.models.loading import save_hf_dir
    from furlong.models.presets import build_preset
    from furlong.models.pretrained import PRETRAINED

    if args.preset in PRETRAINED:
        return _copy_pretrained(args.preset, args.out)
    model, tokenizer = build_preset(args.preset, seed=args.seed)
    out = save_hf_dir(model, tokenizer, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.preset} ({n:,} parameters, seed {args.seed}) to {out}")
    return 0


def _copy_pretrained(name: str, out: str) -> int:
    """The cached directory (built on first use), copied whole and published atomically."""
    import shutil

    from furlong.models.loading import atomic_dir, publish_dir
    from furlong.models.pretrained import MARKER, PRETRAINED, pretrained_dir

    source = pretrained_dir(name)
    tmp, final = atomic_dir(out)
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
    n = json.loads((source / MARKER).read_text())["parameters"]
    print(f"wrote {name} ({n:,} parameters, {PRETRAINED[name].description}) to {final}")
    return 0


def _rollout_server(args: argparse.Namespace) -> int:
    from furlong.rollout.control import cli_policy
    from furlong.rollout.server import MAX_BUCKET_BYTES, serve

    bucket = MAX_BUCKET_BYTES if args.max_bucket_bytes is None else args.max_bucket_bytes
    if bucket <= 0:
        raise InputError(f"--max-bucket-bytes: expected a positive number of bytes, got {bucket}")
    policy = cli_policy("rollout-server", args.admin_token_file, args.weights_dir)
    serve(args.model, args.host, args.port, args.max_running, args.seed, policy, bucket)
    return 0


def _session_server(args: argparse.Namespace) -> int:
    from furlong.rollout.control import cli_policy
    from furlong.rollout.sessions.serve import serve

    policy = cli_policy("session-server", args.admin_token_file, args.weights_dir)
    serve(
        args.model,
        args.host,
        args.port,
        args.pause_mode,
        policy,
        max_running=args.max_running,
        seed=args.seed,
        routing_replay=not args.no_routing_replay,
        engine=args.engine,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from furlong.server.main import serve

    serve(
        base_models=args.base_model or ["tiny-qwen3"],
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        api_keys_file=args.api_keys_file,
        full_finetune=args.full_finetune,
        seed=args.seed,
        hf_home=args.hf_home,
        max_datums=args.max_datums,
        max_tokens_per_datum=args.max_tokens_per_datum,
        max_body_mb=args.max_body_mb,
        max_samples=args.max_samples,
        max_sample_tokens=args.max_sample_tokens,
        compress_fwdbwd=args.compress_fwdbwd,
        trainer_ranks=args.trainer_ranks,
        optimizer_state_dir=args.optimizer_state_dir,
        jwt_auth=args.jwt_auth,
        rollout_engine=args.rollout_engine,
        **{name: getattr(args, name) for name in BOUNDS if getattr(args, name) is not None},
    )
    return 0


# what one key and its sessions may hold in memory (ServiceConfig's fields of the same names)
BOUNDS = {
    "max_models_per_key": (int, "training models one API key may hold loaded (0: no limit)"),
    "session_timeout": (float, "seconds of silence (no heartbeat) that end a session (0: never)"),
    "snapshot_engines": (int, "sampler snapshot engines kept loaded (least recently used go)"),
    "sampler_memory_mb": (int, "MB of snapshot weights they may hold (a LoRA's: its adapter)"),
    "sampler_idle_s": (float, "seconds unused after which a snapshot engine goes (0: never)"),
}


def _control_flags(parser: argparse.ArgumentParser, routes: str, loader: str) -> None:
    """The rollout and session servers' control-plane flags (furlong.rollout.control)."""
    parser.add_argument(
        "--admin-token-file",
        metavar="PATH",
        help=f"the token the control routes ({routes}) ask for, as Authorization: Bearer "
        "<token>; default: $FURLONG_ADMIN_TOKEN, else a new token printed once to stderr",
    )
    parser.add_argument(
        "--weights-dir",
        metavar="DIR",
        help=f"{loader} loads only from inside DIR; default: any path the server can read",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="furlong", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="RL on a tiny offline model on CPU: watch accuracy rise")
    demo.add_argument("--algo", choices=["grpo", "ppo"], default="grpo")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="metrics, curves.png and the policy")
    demo.add_argument("overrides", nargs="*", help="group.field=value, as for furlong train")
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="RL post-training from a TOML config")
    train.add_argument("config", nargs="?", help="a TOML file ([model], [rollout], [algo], ...)")
    train.add_argument("overrides", nargs="*", help="group.field=value, e.g. rollout.group_size=4")
    train.add_argument(
        "--resume",
        metavar="DIR",
        help="continue a run bit-identically from a checkpoint (run.save_every): the run's "
        "out_dir (its latest checkpoint) or one checkpoint directory; without a TOML file the "
        "checkpoint's config is used, overrides on top (e.g. run.steps=200)",
    )
    train.add_argument("--trainer-ranks", type=int, default=1, help="FSDP2 data-parallel ranks")
    train.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="place trainer ranks and rollout engines as Ray actors: a cluster address, or "
        "none to start Ray on this host",
    )
    train.add_argument("--rollout-engines", type=int, default=1, help="with --ray")
    train.add_argument(
        "--ray-colocate", action="store_true", help="with --ray: rank i and engine i share a bundle"
    )
    train.set_defaults(func=_train)

    init = sub.add_parser(
        "init-model",
        help="write a seeded tiny preset, or the pretrained smollm2-135m, as an HF directory",
    )
    init.add_argument("--preset", required=True, choices=model_names())
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0, help="weights seed (tiny presets)")
    init.set_defaults(func=_init_model)

    rollout = sub.add_parser(
        "rollout-server", help="serve the embedded rollout engine over SGLang's HTTP protocol"
    )
    rollout.add_argument("--model", default="tiny-qwen3", help="preset name or local HF dir")
    rollout.add_argument("--host", default="127.0.0.1")
    rollout.add_argument("--port", type=int, default=30000)
    rollout.add_argument("--max-running", type=int, default=32, help="batch slots")
    rollout.add_argument("--seed", type=int, default=0, help="weights seed for a preset")
    _control_flags(rollout, "weights, pause, memory, abort", "/update_weights_from_disk")
    rollout.add_argument(
        "--max-bucket-bytes",
        type=int,
        metavar="N",
        help="largest body /furlong/update_weights_bucket takes (413 past it); default: "
        "4294967296 (4 GiB, furlong.rollout.server.MAX_BUCKET_BYTES)",
    )
    rollout.set_defaults(func=_rollout_server)

    sessions = sub.add_parser(
        "session-server", help="OpenAI-compatible sessions for agents, with token-level records"
    )
    sessions.add_argument("--model", default="tiny-qwen3-moe", help="preset or local HF dir")
    sessions.add_argument("--host", default="127.0.0.1")
    sessions.add_argument("--port", type=int, default=8000)
    sessions.add_argument(  # required: the R3 offsets depend on it (no silent default)
        "--pause-mode",
        choices=["abort", "in_place", "retract"],
        required=True,
        help="what in-flight turns do when weights are published",
    )
    sessions.add_argument("--no-routing-replay", action="store_true", help="MoE: no R3 rows")
    sessions.add_argument("--max-running", type=int, default=32, help="batch slots")
    sessions.add_argument(
        "--engine", default="embedded", help="rollout engine kind (furlong.rollout.registry)"
    )
    sessions.add_argument("--seed", type=int, default=0, help="weights seed for a preset")
    _control_flags(sessions, "sessions, records, samples, weights", "POST /weights")
    sessions.set_defaults(func=_session_server)

    serve = sub.add_parser("serve", help="the Tinker-compatible training service")
    serve.add_argument(
        "--base-model",
        action="append",
        metavar="[NAME=]PRESET|DIR",
        help="a served base model, repeatable; NAME is what clients ask for "
        "(e.g. Qwen/Qwen3-8B-Base=tiny-qwen3); default: tiny-qwen3",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--state-dir", default="furlong-state", help="checkpoints and runs")
    serve.add_argument("--api-keys-file", help="one accepted key per line (default: any tml-*)")
    serve.add_argument("--full-finetune", action="store_true", help="allow non-LoRA models")
    serve.add_argument("--seed", type=int, default=0, help="weights seed for presets")
    serve.add_argument(
        "--hf-home",
        help="write each served NAME's tokenizer and config into this HF hub cache, so clients "
        "(e.g. tinker-cookbook) load them offline with HF_HOME=DIR HF_HUB_OFFLINE=1",
    )
    serve.add_argument("--max-datums", type=int, default=4096, help="per forward_backward")
    serve.add_argument("--max-tokens-per-datum", type=int, default=32_768)
    serve.add_argument(
        "--max-body-mb", type=int, default=256, help="request body limit, also once inflated (413)"
    )
    serve.add_argument("--max-samples", type=int, default=1024, help="num_samples per request")
    serve.add_argument(
        "--max-sample-tokens",
        type=int,
        default=4096,
        help="max_tokens per sample request (also bounded by the model's context)",
    )
    serve.add_argument(
        "--compress-fwdbwd", action="store_true", help="ask clients to zstd forward_backward"
    )
    serve.add_argument(
        "--trainer-ranks", type=int, default=1, help="FSDP2 ranks per full fine-tune (LoRA: 1)"
    )
    serve.add_argument(
        "--optimizer-state-dir",
        help="keep every model's optimizer state in file-backed mappings in this directory "
        "(a real disk, not tmpfs); default: in memory",
    )
    serve.add_argument(
        "--jwt-auth",
        action="store_true",
        help="clients exchange their key for a short-lived JWT (auth/token), as the tinker SDK "
        "does when the server asks; RestClient.whoami() needs it",
    )
    serve.add_argument(
        "--rollout-engine",
        default="embedded",
        help="the samplers' engine kind (furlong.rollout.registry; default: embedded)",
    )
    for name, (kind, text) in BOUNDS.items():  # unset: ServiceConfig's default
        serve.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:  # a user error: the message names what to change
        print(f"furlong {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
