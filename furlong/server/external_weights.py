"""External weights (``save_weights_external``): a training model exported as a directory any
Hugging Face tool loads, and the signed URLs its files are downloaded from.

A LoRA model exports a standard peft adapter (``adapter_config.json`` naming the served base,
``adapter_model.safetensors``), which is what tinker-cookbook's ``weights.build_hf_model`` /
``build_lora_adapter`` take; a full fine-tune exports an HF model directory (config, weights,
tokenizer). Files are fetched with plain GETs that carry no header (tinker-cookbook's
``weights.download`` uses ``urllib.request.urlretrieve``), so each URL carries a token: an
HMAC, under a secret of this server process, of the owner, the file and an expiry time.

With ``age_encryption_recipients`` every file is stored encrypted as ``<file>.age``
(age_encryption.py); the same signed URLs serve the sampler-snapshot archives of
checkpoint_archive.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from furlong.models.loading import atomic_dir, publish_dir
from furlong.server import age_encryption
from furlong.server.age_encryption import Recipient
from furlong.server.models import SNAPSHOT_META, TrainingModel
from furlong.server.state import CheckpointRef, dir_size

URL_LIFETIME = 3600  # seconds a download URL stays valid (the cookbook re-signs 5 min before)
ADAPTER_CONFIG = "adapter_config.json"


def export(model: TrainingModel, path: Path, recipients: Sequence[Recipient] = ()) -> int:
    """Write ``model``'s weights at ``path`` as an HF directory, atomically; returns its size.
    With ``recipients`` every file is encrypted to them and named ``<file>.age``.

    The sampler-snapshot writer already produces exactly these files: it writes into the temp
    directory, its own metadata file is dropped, the files are encrypted there (the plain
    copies never reach the published directory), and the result is published whole."""
    tmp, final = atomic_dir(path)
    staged = tmp / "export"
    try:
        model.save_sampler_weights(staged)
        (staged / SNAPSHOT_META).unlink(missing_ok=True)
        if model.is_lora:
            config = staged / ADAPTER_CONFIG
            config.write_bytes(name_base_model(config.read_bytes(), model.base_model))
        if recipients:
            age_encryption.encrypt_files(staged, files(staged), recipients)
        publish_dir(staged, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dir_size(final)


def name_base_model(adapter_config: bytes, base_model: str) -> bytes:
    """peft records where the base came from (a local preset here); name the served model, so
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(name), dir)`` reads right."""
    config = json.loads(adapter_config)
    config["base_model_name_or_path"] = base_model
    return json.dumps(config, indent=2, sort_keys=True).encode()


def files(path: Path) -> list[str]:
    """The regular files of an export, relative POSIX paths (symlinks are never served)."""
    found = (p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return sorted(p.relative_to(path).as_posix() for p in found)


class InvalidDownloadToken(Exception):
    """A download URL's token is malformed, forged, for another file, or expired (HTTP 401)."""


class DownloadSigner:
    """Tokens for download URLs: ``<owner>.<expires>.<hmac>``. The owner is the tenant id
    (a hash of the key), never the key; the secret lives only in this process, so URLs die
    with it and clients ask for new ones."""

    def __init__(self, clock: Callable[[], float], lifetime: int = URL_LIFETIME):
        self._clock = clock
        self._lifetime = lifetime
        self._secret = secrets.token_bytes(32)

    def expiry(self) -> int:
        return int(self._clock()) + self._lifetime

    def token(self, owner: str, ref: CheckpointRef, file: str, expires: int) -> str:
        return f"{owner}.{expires}.{self._mac(owner, ref, file, expires)}"

    def verify(self, token: str, ref: CheckpointRef, file: str) -> str:
        """The owner the token was issued to, if it is genuine, for this file and unexpired."""
        owner, _, rest = token.partition(".")
        expires, _, mac = rest.partition(".")
        if not owner or not (expires.isascii() and expires.isdigit()):
            raise InvalidDownloadToken("token: malformed; ask for new URLs")
        want = self._mac(owner, ref, file, int(expires))
        if not hmac.compare_digest(mac.encode(), want.encode()):
            raise InvalidDownloadToken("token: not valid for this file (or the server restarted)")
        if self._clock() >= int(expires):
            raise InvalidDownloadToken("token: expired; ask for new URLs")
        return owner

    def _mac(self, owner: str, ref: CheckpointRef, file: str, expires: int) -> str:
        message = "\n".join((owner, ref.uri, file, str(expires))).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()
