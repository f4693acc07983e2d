"""Is a model name usable? Every front door (train, serve, the rollout and session servers) asks
at start-up, before torch loads or a port opens: a typo, or a hub id that is not cached while
the hub cannot be reached, fails in well under a second with what to do, instead of minutes of
hub retries at the first request.

Torch-free; huggingface_hub is imported only for a hub id."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from furlong.errors import InputError, did_you_mean, nearest
from furlong.models.pretrained import model_names

PROBE_TIMEOUT_S = 1.0  # a reachable hub answers a TCP connect far sooner
# one start checks a name at several doors (CLI, serve(), RLConfig.validate, load_model): they
# share a probe's answer for this long instead of each waiting up to PROBE_TIMEOUT_S
PROBE_REUSE_S = 60.0
_probes: dict[tuple[str, int], tuple[float, bool]] = {}
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a set flag
# a hub id as huggingface_hub spells one: [namespace/]name of word characters, "-" and "."
_HUB_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+")
_DEFAULT_ENDPOINT = "https://huggingface.co"


def check_model(spec: str, field: str, hint: str | None = None) -> None:
    """Refuse a model name that cannot load, with an :class:`InputError` naming ``field``.

    Fine: a preset or pretrained name, a local directory holding config.json, a hub id whose
    config.json is in the local HF cache, or (when the hub answers) any other hub id. ``hint``
    says what to do instead when a hub id cannot be fetched (default: give a preset or a local
    directory to ``field``)."""
    spec = str(spec)
    if spec in model_names():
        return
    if not spec.strip():
        raise InputError(f"{field}: empty name; give {_kinds()}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{field}: directory {spec!r} has no config.json (not an HF model)")
        return
    if path.exists():
        raise InputError(f"{field}: {spec!r} is a file; give {_kinds()}")
    if spec.startswith((".", "~")) or not _HUB_ID.fullmatch(spec):  # a path, not a hub id
        raise InputError(f"{field}: no such directory {spec!r}; give {_kinds()}{_suggest(spec)}")
    if _cached(spec):
        return
    bare = "/" not in spec  # no namespace: far likelier a mistyped preset than a legacy hub id
    if bare and closest(spec):
        raise InputError(
            f"{field}: {spec!r} is not a model furlong knows ({', '.join(model_names())}), "
            f"nor a local directory{_suggest(spec)} (a hub model: its full id, ORG/NAME)"
        )
    why = hub_unreachable()
    if why is None:
        return  # the hub answers for it when the model loads
    todo = hint or f"give {field} a preset (e.g. tiny-qwen3) or a local HF directory"
    raise InputError(
        f"{field}: {spec!r} is {describe()}, and the hub is unreachable ({why}); {todo}, "
        f"or fetch it where the hub is reachable (hf download {spec}){_suggest(spec)}"
    )


def describe() -> str:
    """What a model name is not when it cannot be found; load_model says the same."""
    return (
        f"not a model name furlong knows ({', '.join(model_names())}), a local HF directory, "
        "or a hub model in the local HF cache"
    )


def closest(spec: str) -> str | None:
    """The known model name nearest ``spec`` (its part after any ``ORG/``), if one is close."""
    return nearest(_bare(spec), model_names())


def hub_unreachable() -> str | None:
    """Why the hub cannot serve a download now (offline flag, no connection), or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in _TRUE:
            return f"{var} is set"
    endpoint = (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")
    host, port = _first_hop(endpoint)
    if not _connects(host, port):
        return f"no connection to {host}:{port} within {PROBE_TIMEOUT_S:g} s"
    return None


def _kinds() -> str:
    return f"a furlong model ({', '.join(model_names())}), a local HF directory or a hub id"


def _suggest(spec: str) -> str:
    return did_you_mean(_bare(spec), model_names())


def _bare(spec: str) -> str:
    """A model name as furlong's names are spelled: its part after any ``ORG/``, lower case."""
    return spec.rsplit("/", 1)[-1].lower()


def _cached(repo_id: str) -> bool:
    """Its config.json is in the HF cache, where from_pretrained finds it offline."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # huggingface_hub refuses the id ("--", "..", ...)
        return False
    return isinstance(found, str)  # not None, not the "known missing" marker


def _first_hop(endpoint: str) -> tuple[str, int]:
    """The host a download connects to first: the endpoint's, or its proxy's."""
    from urllib.request import getproxies, proxy_bypass

    url = urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    proxy = getproxies().get(url.scheme or "https")
    if proxy and not proxy_bypass(host):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host = url.hostname or host
    return host, url.port or (443 if url.scheme == "https" else 80)


def _connects(host: str, port: int) -> bool:
    """A TCP connect within the timeout, the answer reused for PROBE_REUSE_S."""
    now = time.monotonic()
    seen = _probes.get((host, port))
    if seen is not None and now - seen[0] < PROBE_REUSE_S:
        return seen[1]
    ok = _probe(host, port)
    _probes[(host, port)] = (now, ok)
    return ok


def _probe(host: str, port: int) -> bool:
    """A TCP connect within the timeout, name lookup included (in a thread: getaddrinfo has no
    timeout of its own)."""
    ok = threading.Event()

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                ok.set()
        except OSError:
            pass

    probe = threading.Thread(target=attempt, daemon=True, name="furlong-hub-probe")
    probe.start()
    probe.join(PROBE_TIMEOUT_S)
    return ok.is_set()
