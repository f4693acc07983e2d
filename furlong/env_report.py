"""``furlong env``: what this install is and what it runs on, for a bug report or a check.

It names where furlong was imported from (an installed wheel or a checkout), the versions of
the libraries it runs on, which extras are installed, the CPU kernel set ATen and the
precision code see, whether furlong's fused CPU kernels built on this machine (or why not: a
fallback is otherwise silent), and whether the vLLM engine's venv is there."""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import furlong
from furlong.extras import EXTRAS, missing

LIBRARIES = ("torch", "transformers", "peft", "tokenizers", "safetensors", "tinker", "ray")


def collect() -> dict[str, Any]:
    """The report as plain values (``furlong env --json`` prints it as is)."""
    import torch

    from furlong.models.fused_kernels import kernel_build
    from furlong.precision import describe_bf16

    kernels, detail = kernel_build()
    return {
        "furlong": furlong.__version__,
        "location": str(Path(furlong.__file__).parent),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "extras": {extra: not missing(extra) for extra in EXTRAS},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16": describe_bf16(),
        "threads": torch.get_num_threads(),
        "fused_kernels": "built" if kernels is not None else "unavailable",
        "fused_kernels_detail": detail,
        "vllm": _vllm(),
    }


def _vllm() -> str:
    """Whether ``rollout.vllm_python = "auto"`` finds a venv, and whether vLLM can run here."""
    from furlong.rollout import vllm_venv

    why = vllm_venv.cpu_support()
    if why:
        return f"cannot run here: {why}"
    if vllm_venv.is_built():
        return f"{vllm_venv.VLLM} at {vllm_venv.default_venv()}"
    return f"no venv at {vllm_venv.default_venv()} (make vllm-venv)"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def render(report: dict[str, Any], as_json: bool = False) -> str:
    if as_json:
        return json.dumps(report, indent=2)
    libraries = ", ".join(f"{k} {v or '-'}" for k, v in report["libraries"].items())
    extras = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["extras"].items())
    rows = [
        ("furlong", f"{report['furlong']} ({report['location']})"),
        ("python", f"{report['python']} on {report['platform']}"),
        ("libraries", libraries),
        ("extras", extras),
        ("cpu", f"ATen kernels {report['cpu_capability']}; bf16: {report['bf16']}"),
        ("threads", str(report["threads"])),
        ("fused kernels", f"{report['fused_kernels']}: {report['fused_kernels_detail']}"),
        ("vllm", report["vllm"]),
    ]
    return "\n".join(f"{name:<15}{value}" for name, value in rows)
