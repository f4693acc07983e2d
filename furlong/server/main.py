"""Start ``furlong serve``: check every flag and open the port, then load and run uvicorn.

Importing this module is cheap, and :func:`serve` checks the served base models, the keys
file, the numbers, the directories and the port before torch loads: a mistake is one
:class:`InputError` naming its flag at once, not after the models have loaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from furlong.errors import InputError
from furlong.extras import require
from furlong.listen import bind
from furlong.models.names import check_model
from furlong.server.bounds import BOUNDS

DEFAULT_STATE_DIR = "furlong-state"  # the CLI's --state-dir default, relative to the cwd


def parse_base_models(specs: list[str]) -> dict[str, str]:
    """``NAME=PRESET|DIR`` (or a bare ``PRESET|DIR``, served under its own name); each source
    must resolve (furlong.models.names), so an unusable one fails before the port opens."""
    out: dict[str, str] = {}
    for i, spec in enumerate(specs):
        name, sep, source = spec.partition("=")
        name, source = (name, source) if sep else (spec, spec)
        if not name or not source:
            raise InputError(f"--base-model[{i}]: {spec!r} is not NAME=PRESET|DIR")
        hint = f"serve a preset under that name: --base-model {name}=tiny-qwen3"
        check_model(source, f"--base-model[{i}]", hint)
        out[name] = source
    return out


def read_api_keys(path: str | None) -> frozenset[str] | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InputError(f"--api-keys-file: cannot read {path!r} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise InputError(f"--api-keys-file: {path!r} is not text ({e})") from None
    keys = frozenset(line.strip() for line in text.splitlines() if line.strip())
    if not keys:
        raise InputError(f"--api-keys-file: {path!r} lists no keys")
    return keys


def serve(
    base_models: list[str],
    host: str,
    port: int,
    state_dir: str,
    api_keys_file: str | None,
    full_finetune: bool,
    seed: int,
    hf_home: str | None = None,
    max_datums: int = 4096,
    max_tokens_per_datum: int = 32_768,
    max_body_mb: int = 256,
    max_samples: int = 1024,
    max_sample_tokens: int = 4096,
    compress_fwdbwd: bool = False,
    trainer_ranks: int = 1,
    dtype: str = "float32",
    optimizer_state_dir: str | None = None,
    jwt_auth: bool = False,
    rollout_engine: str = "embedded",
    rollout_urls: list[str] | None = None,
    vllm_python: str = "",
    **bounds: Any,
) -> None:
    """``bounds``: ServiceConfig's memory bounds by name (furlong.server.bounds)."""
    require("server", "furlong serve")
    keys = read_api_keys(api_keys_file)
    served = parse_base_models(base_models)
    counts = {
        "max_datums": max_datums,
        "max_tokens_per_datum": max_tokens_per_datum,
        "max_body_mb": max_body_mb,
        "max_samples": max_samples,
        "max_sample_tokens": max_sample_tokens,
        "trainer_ranks": trainer_ranks,
    }
    check_numbers(counts, bounds)
    check_writable_dir(state_dir, "--state-dir")
    check_writable_dir(optimizer_state_dir, "--optimizer-state-dir")
    check_writable_dir(hf_home, "--hf-home")
    sock = bind(host, port)  # the last check; uvicorn serves this socket

    from furlong.models.loading import resolve
    from furlong.server.app import create_app
    from furlong.server.config import ServiceConfig
    from furlong.server.service import Service
    from furlong.serving import run_announced

    config = ServiceConfig(
        base_models=served,
        state_dir=Path(state_dir),
        full_finetune=full_finetune,
        seed=seed,
        max_datums=max_datums,
        max_tokens_per_datum=max_tokens_per_datum,
        max_samples=max_samples,
        max_sample_tokens=max_sample_tokens,
        compress_fwdbwd=compress_fwdbwd,
        trainer_ranks=trainer_ranks,
        dtype=dtype,
        optimizer_state_dir=optimizer_state_dir,
        jwt_auth=jwt_auth,
        rollout_engine=rollout_engine,
        rollout_options=_rollout_options(rollout_urls or [], vllm_python),
        **bounds,
    )
    for source in config.base_models.values():
        resolve(source)  # a pretrained model is built (once) before the port opens, not mid-request
    if hf_home is not None:  # clients resolve the served names offline (tinker-cookbook)
        from furlong.server.hub_cache import write_hub_cache

        for name, source in config.base_models.items():
            write_hub_cache(Path(hf_home), name, source)
        print(
            f"furlong serve: tokenizers in {hf_home} (clients: HF_HOME={hf_home} HF_HUB_OFFLINE=1)",
            file=sys.stderr,
        )
    service = Service(config)
    if keys is None:
        print(
            "furlong serve: no --api-keys-file, so any tml-... key is accepted",
            file=sys.stderr,
        )
    models, state = sorted(config.base_models), _where_state(state_dir)
    run_announced(
        create_app(service, keys, max_body_mb << 20),
        host,
        port,
        lambda url: f"furlong serve: {models} on {url} (TINKER_BASE_URL), state in {state}",
        sock,
    )


def check_numbers(counts: dict[str, int], bounds: dict[str, Any]) -> None:
    """``counts`` (by name) are integers >= 1 and ``bounds`` within their least values
    (furlong.server.bounds); an error names the flag."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{_flag(name)}: expected an integer >= 1, got {value!r}")
    for name, value in bounds.items():
        least = BOUNDS[name].least
        if not value >= least:
            raise InputError(f"{_flag(name)}: must be >= {least:g}, got {value!r}")


def check_writable_dir(path: str | None, flag: str) -> None:
    """``path`` (None: not given) is a directory this process may write in, or one it may
    create: its nearest existing ancestor is such a directory. Nothing is created here."""
    if path is None:
        return
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = (
            "is not a directory" if existing == target else f"cannot be made ({existing} is a file)"
        )
        raise InputError(f"{flag}: {path!r} {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == target else f" (in {existing}, to create it)"
        raise InputError(f"{flag}: {path!r}: permission denied{where}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _where_state(state_dir: str) -> str:
    """The state directory as an absolute path, and whether it is the default (which follows
    the current directory)."""
    where = str(Path(state_dir).resolve())
    if state_dir == DEFAULT_STATE_DIR:
        where += f" (default: ./{DEFAULT_STATE_DIR}; --state-dir to move it)"
    return where


def _rollout_options(urls: list[str], vllm_python: str) -> dict[str, Any]:
    """The samplers' engine options from ``--rollout-url`` and ``--vllm-python``."""
    options: dict[str, Any] = {}
    if urls:
        options["urls"] = list(urls)
    if vllm_python:
        options["vllm_python"] = vllm_python
    return options
