"""furlong's optional extras: what each brings and which front doors need it.

``pip install furlong`` is the library, the RL loop and its CLI (``demo``, ``train``,
``init-model``), LoRA included. ``furlong[server]`` adds the HTTP front doors (``serve``,
``rollout-server``, ``session-server``); ``furlong[ray]`` adds Ray placement (``--ray``,
``rollout.engine = "ray"``). A front door that needs an extra calls :func:`require` before it
imports anything heavy, so a missing install is one line naming the extra to install.
``tests/test_packaging.py`` checks both tables against pyproject.toml's dependencies and the
imports of each door's modules.
"""

from __future__ import annotations

from importlib.util import find_spec

from furlong.errors import InputError

# extra -> the modules furlong imports from it, one per distribution the extra lists
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": (
        "fastapi",
        "starlette",
        "pydantic",
        "uvicorn",
        "tinker",
        "google.protobuf",
        "zstandard",
        "pyrage",
    ),
    "ray": ("ray",),
    # task sources (furlong.rl.task_sources) and the math-equivalence verifier
    "tasks": ("reasoning_gym", "datasets", "math_verify"),
}
# what each front door loads (its modules' imports, followed through furlong): "core" needs
# only the package's own dependencies, an extra's doors that extra besides
DOORS: dict[str, tuple[str, ...]] = {
    "core": (
        "furlong.cli",
        "furlong.demo",
        "furlong.rl.loop",
        "furlong.train.engine",
        "furlong.train.lora",
        "furlong.rollout.engine",
        "furlong.rollout.sglang_client",
    ),
    "server": (
        "furlong.server.main",
        "furlong.server.app",
        "furlong.server.service",
        "furlong.rollout.server",
        "furlong.rollout.sessions.serve",
        "furlong.serving",
    ),
    "ray": ("furlong.rl.ray_rollout", "furlong.rl.ray_trainer", "furlong.rl.scale_out"),
    "tasks": (
        "furlong.rl.reasoning_gym_task",
        "furlong.rl.datasets_task",
        "furlong.rl.math_equivalence",
    ),
}


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or those of ``modules``, which it brings) that are not
    installed (found without importing them)."""
    return [module for module in modules or EXTRAS[extra] if find_spec(module) is None]


def extra_of(package: str) -> str | None:
    """The extra that installs top-level ``package``, if one does."""
    tops = {extra: {m.partition(".")[0] for m in mods} for extra, mods in EXTRAS.items()}
    return next((extra for extra, names in tops.items() if package in names), None)


def install_hint(extra: str) -> str:
    return f"pip install 'furlong[{extra}]'"


def require(extra: str, door: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise :class:`InputError` naming ``door`` (a command, flag or config field) and the
    install line when ``extra`` (or the part of it in ``modules``) is not installed."""
    gone = missing(extra, modules)
    if gone:
        raise InputError(
            f"{door} needs furlong's {extra!r} extra ({', '.join(gone)} not installed): "
            f"{install_hint(extra)}"
        )
