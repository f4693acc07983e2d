"""Publish a served model's tokenizer under its hub name in a local Hugging Face hub cache.

Why: tinker-cookbook recipes (and the SDK's ``get_tokenizer()``) call
``AutoTokenizer.from_pretrained("Qwen/Qwen3-8B-Base")`` by *name*. With no network, that only
resolves from ``$HF_HOME/hub``. Writing the furlong preset's (or local dir's) tokenizer there
under the served name lets the client and the server tokenize identically, fully offline
(``HF_HOME=... HF_HUB_OFFLINE=1``).

Layout written (what ``huggingface_hub`` reads offline)::

    $HF_HOME/hub/models--<Org>--<Name>/refs/main            -> "<rev>"
    $HF_HOME/hub/models--<Org>--<Name>/snapshots/<rev>/{tokenizer.json,
        tokenizer_config.json, chat_template.jinja, config.json}

``<rev>`` is a content hash, so rewriting the same tokenizer is a no-op and a changed one gets
a new snapshot; the snapshot is published by renaming a finished temp dir, and ``refs/main`` is
replaced atomically, so a concurrent reader sees either the old or the new tokenizer, whole.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path

from furlong.atomic import atomic_write_text, fsync_path
from furlong.errors import InputError
from furlong.models.loading import load_tokenizer, resolve
from furlong.models.presets import PRESETS

# A hub repo id: "Name" or "Org/Name" (no "--" or "..", which the cache layout cannot encode).
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_name(name: str) -> None:
    if not _REPO_ID.match(name) or "--" in name or ".." in name or name.endswith("."):
        raise InputError(
            f"hub cache: {name!r} is not a hub model id (ORG/NAME or NAME, no '--' or '..')"
        )


def _config_json(source: str, tokenizer: object) -> dict:
    """The served model's config (architecture, vocab_size), without building its weights."""
    if source in PRESETS:
        return PRESETS[source].make_config(tokenizer).to_dict()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve(source)).to_dict()
    except (OSError, ValueError) as exc:
        raise InputError(f"hub cache: config of {source!r} cannot be loaded ({exc})") from None


def write_hub_cache(hf_home: Path, name: str, source: str) -> Path:
    """Write ``source``'s tokenizer and config as hub model ``name`` under ``hf_home``.

    ``source`` is a furlong model name (``tiny-qwen3``, ``smollm2-135m``) or a local HF
    directory. Returns the snapshot directory. Idempotent; safe against concurrent writers and
    readers.
    """
    _check_name(name)
    tokenizer = load_tokenizer(source)
    repo = Path(hf_home) / "hub" / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=snapshots))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a cache may be read by another user
        tokenizer.save_pretrained(tmp)
        config = _config_json(source, tokenizer)
        config["_name_or_path"] = name
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        digest = hashlib.sha1()
        for f in sorted(tmp.iterdir()):
            digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
            fsync_path(f)
        rev = digest.hexdigest()  # 40 hex digits, like a commit hash
        final = snapshots / rev
        if final.is_dir():
            shutil.rmtree(tmp)  # same content already published
        else:
            try:
                tmp.rename(final)
            except OSError:  # a concurrent writer published the same snapshot first
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    atomic_write_text(repo / "refs" / "main", rev)  # no newline: huggingface_hub reads it verbatim
    return final
