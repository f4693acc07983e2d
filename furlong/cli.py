"""The `furlong` command line: demo | train | eval | init-model | rollout-server | session-server |
serve | env."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from furlong import __version__
from furlong.errors import InputError, did_you_mean
from furlong.models.pretrained import model_names
from furlong.precision import DTYPES
from furlong.server.bounds import BOUNDS

if TYPE_CHECKING:
    import socket

    from furlong.rollout.control import ControlPolicy

# Nothing heavy is imported at module level: `--help`, `--version` and a usage error answer
# without torch (benchmarks/cli_startup.py); each command imports what it needs.


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
    from furlong.rl.config_source import check_model_name, raw_config

    config, overrides = args.config, [*first, *args.overrides]
    if config is not None and _is_override(config):
        config, overrides = None, [*first, config, *args.overrides]  # only overrides were given
    model = raw_config(config_file or config, overrides).get("model")  # before torch loads
    check_model_name(model.get("name") if isinstance(model, dict) else None)

    from furlong.rl.config import load_config
    from furlong.rl.scale import ScaleOut

    flags = ScaleOut(args.trainer_ranks, args.ray, args.rollout_engines, args.ray_colocate)
    for name, value in dataclasses.asdict(flags).items():  # flags beat the file, as overrides
        if value != getattr(ScaleOut(), name):
            overrides.append(f"scale.{name}={json.dumps(value)}")
    return load_config(config_file or config, overrides)


def _is_override(word: str) -> bool:
    """The first positional is an override, not a config file: it has an ``=``, or it is
    ``group.field`` with no such file (then the override parser names what is missing)."""
    if word.endswith(".toml") or Path(word).exists():
        return False
    return "=" in word or "." in word


def _train(args: argparse.Namespace) -> int:
    config = train_config(args) if args.resume is None else _resume_config(args)
    from furlong.rl.loop import train  # after the config: its mistakes need no RL stack

    summary = train(config, resume=args.resume)
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


def _eval(args: argparse.Namespace) -> int:
    from furlong.rl import eval_command as ev

    words = [*args.words, *(args.compare or [])]
    models = [w for w in words if not _is_override(w) or Path(w).exists()]
    overrides = [w for w in words if w not in models]
    if args.show:
        if len(models) != 1:
            raise InputError("eval --show: name one run directory")
        print(ev.show_samples(models[0], args.step, args.mode, args.wrong, args.limit))
        return 0
    if not models or len(models) > 2:
        raise InputError(f"eval: name one model, or two with --compare (got {models})")
    configs = [ev.run_config(m, args.config, overrides) for m in models]
    scored = [
        ev.score(m, c, args.samples, args.pass_k, args.seed)
        for m, c in zip(models, configs, strict=True)
    ]
    print(ev.table(scored))
    print()
    print(ev.side_by_side(scored, args.examples))
    out = ev.write_report(args.out, ev.report(scored, configs[0]))
    print(f"\nwritten: {out}")
    return 0


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
    bucket = args.max_bucket_bytes
    if bucket is not None and bucket <= 0:
        raise InputError(f"--max-bucket-bytes: expected a positive number of bytes, got {bucket}")
    policy, sock = _rollout_front(args, "rollout-server")
    from furlong.rollout.server import MAX_BUCKET_BYTES, serve

    bucket = MAX_BUCKET_BYTES if bucket is None else bucket
    serve(args.model, args.host, args.port, args.max_running, args.seed, policy, bucket, sock=sock)
    return 0


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rollout-url",
        action="append",
        default=[],
        metavar="URL",
        help="engine sglang/vllm: a running server's base URL (repeat for several)",
    )
    parser.add_argument(
        "--vllm-python",
        default="",
        metavar="PYTHON",
        help="engine vllm: start vLLM with this Python ('auto': make vllm-venv's)",
    )


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--rollout-url`` and ``--vllm-python`` as the engine kind's options."""
    options: dict[str, Any] = {}
    if args.rollout_url:
        options["urls"] = list(args.rollout_url)
    if args.vllm_python:
        options["vllm_python"] = args.vllm_python
    return options


def _session_server(args: argparse.Namespace) -> int:
    policy, sock = _rollout_front(args, "session-server")
    from furlong.rollout.sessions.serve import serve

    serve(
        args.model,
        args.host,
        args.port,
        args.pause_mode,
        policy,
        sock=sock,
        max_running=args.max_running,
        seed=args.seed,
        routing_replay=not args.no_routing_replay,
        engine_options=_engine_options(args),
        engine=args.engine,
    )
    return 0


def _rollout_front(args: argparse.Namespace, command: str) -> tuple[ControlPolicy, socket.socket]:
    """The rollout and session servers' checks before torch loads: the server extra, the
    model, the batch slots, the control flags, then the port (opened here: the socket is what
    uvicorn serves). A generated admin token is shown once all of them passed."""
    from furlong.extras import require
    from furlong.listen import bind
    from furlong.models.names import check_model
    from furlong.rollout.control import cli_policy

    require("server", "this command")
    check_model(args.model, "--model")
    if args.max_running < 1:
        raise InputError(f"--max-running: expected an integer >= 1, got {args.max_running}")
    policy, generated = cli_policy(args.admin_token_file, args.weights_dir)
    sock = bind(args.host, args.port)
    if generated:
        token = policy.admin_token
        print(f"furlong {command}: admin token for control routes: {token}", file=sys.stderr)
    return policy, sock


def _serve(args: argparse.Namespace) -> int:
    from furlong.extras import require
    from furlong.server.main import serve  # checks every flag and the port before torch loads

    require("server", "this command")
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
        dtype=args.dtype,
        optimizer_state_dir=args.optimizer_state_dir,
        jwt_auth=args.jwt_auth,
        rollout_engine=args.rollout_engine,
        rollout_urls=args.rollout_url,
        vllm_python=args.vllm_python,
        **{name: getattr(args, name) for name in BOUNDS},
    )
    return 0


def _env(args: argparse.Namespace) -> int:
    from furlong.env_report import collect, render

    print(render(collect(), as_json=args.json))
    return 0


def _listen_flags(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every one)"
    )
    parser.add_argument("--port", type=int, default=port, help="TCP port")


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


class _Help(argparse.HelpFormatter):
    """Each option's default in its help, where it has one worth saying (not None, not off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        quiet = action.default is None or action.default is False  # (0 == False: by identity)
        if quiet or action.default == argparse.SUPPRESS or "default" in text:
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: %(default)s)".lstrip()
        return text


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, with the closest flag or choice when one was mistyped. A flag
    must be spelled whole: argparse would take ``--trainer-rank`` as ``--trainer-ranks`` (and
    a prefix that is whole today may name another flag tomorrow). Subparsers are built by this
    class too (``add_subparsers`` uses the parent's), so every parser of the CLI refuses it."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}{self._did_you_mean(message)} (see --help)\n")

    def _did_you_mean(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)'", message)
        if choice:
            words = [choice.group(1)]
            known = [str(c) for a in self._actions if a.choices for c in a.choices]
        elif message.startswith("unrecognized arguments:"):
            words = message.partition(":")[2].split()
            known = [o for a in self._actions for o in a.option_strings]
        else:
            return ""
        for word in words:
            hint = did_you_mean(word.partition("=")[0], known, quote=str)
            if hint:
                return hint
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="furlong", description=__doc__)
    parser.add_argument("--version", action="version", version=f"furlong {__version__}")
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

    ev = sub.add_parser(
        "eval",
        help="score a model (preset, HF directory, run or checkpoint) on a task's held-out split",
    )
    ev.add_argument(
        "words",
        nargs="*",
        metavar="MODEL | group.field=value",
        help="the model, then overrides (task.name=reasoning_gym:chain_sum, task.eval_size=50)",
    )
    ev.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two models side by side")
    ev.add_argument("--config", help="a TOML file for the task and sampling (default: the run's)")
    ev.add_argument("--samples", type=int, help="draws per problem (default: task.eval_samples)")
    ev.add_argument("--pass-k", type=int, help="> 1: pass@k from the draws (task.eval_pass_k)")
    ev.add_argument("--seed", type=int, default=0, help="the sampled draws' seed")
    ev.add_argument("--examples", type=int, default=5, help="greedy replies printed per model")
    ev.add_argument("--out", default="eval.json", help="the JSON report (metrics, every reply)")
    ev.add_argument("--show", action="store_true", help="print a run's samples.jsonl instead")
    ev.add_argument("--step", type=int, help="with --show: this step (default: the last eval)")
    ev.add_argument("--mode", choices=["greedy", "sampled", "train"], help="with --show")
    ev.add_argument("--wrong", action="store_true", help="with --show: wrong replies only")
    ev.add_argument("--limit", type=int, default=10, help="with --show: replies printed")
    ev.set_defaults(func=_eval)

    init = sub.add_parser(
        "init-model",
        help="write a seeded tiny preset, or the pretrained smollm2-135m, as an HF directory",
    )
    init.add_argument("--preset", required=True, choices=model_names())
    init.add_argument("--out", required=True, help="the HF directory to write (atomically)")
    init.add_argument("--seed", type=int, default=0, help="weights seed (tiny presets)")
    init.set_defaults(func=_init_model)

    rollout = sub.add_parser(
        "rollout-server", help="serve the embedded rollout engine over SGLang's HTTP protocol"
    )
    rollout.add_argument("--model", default="tiny-qwen3", help="preset name or local HF dir")
    _listen_flags(rollout, 30000)  # SGLang's default port
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
    _listen_flags(sessions, 8100)  # beside serve's 8000
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
    _engine_flags(sessions)
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
    _listen_flags(serve, 8000)
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
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the base models' precision; bfloat16 trains fp32 master weights (LoRA adapters: "
        "fp32) and computes log-probs in fp32; auto: bfloat16 where the CPU/GPU has native "
        "bf16 matmuls (AMX, AVX-512 BF16, CUDA), else float32",
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
    _engine_flags(serve)
    for name, bound in BOUNDS.items():
        flag = "--" + name.replace("_", "-")
        serve.add_argument(flag, type=bound.kind, default=bound.default, help=bound.help)
    serve.set_defaults(func=_serve)

    env = sub.add_parser(
        "env", help="this install: versions, extras, CPU kernels, the fused kernels' build"
    )
    env.add_argument("--json", action="store_true", help="as one JSON object")
    env.set_defaults(func=_env)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags may follow the positionals (``furlong train X run.steps=2 --trainer-ranks 2``):
    what the top-level parse leaves over is parsed again by the command's own parser, which
    also makes a mistyped flag an error in that command's words."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if not rest:
        return args
    command = _commands(parser)[args.command]
    words = argv[argv.index(args.command) + 1 :]
    return command.parse_intermixed_args(words, argparse.Namespace(command=args.command))


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("furlong's parser has its commands")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.func(args)
    except InputError as e:  # a user error: the message names what to change
        print(f"furlong {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
