"""furlong as a user installs it: the wheel and the sdist carry every file the package reads
(furlong.package_data.FILES), their metadata passes twine's check, and each front door
imports only the dependencies its install brings (furlong.extras). ``make install-check``
goes further: a fresh venv from the wheel runs the demo and the service."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from furlong import __version__
from furlong.errors import InputError
from furlong.extras import DOORS, EXTRAS, require
from furlong.package_data import FILES, package_file

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "furlong"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {_normal(Requirement(r).name) for r in requirements}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _source_files() -> list[str]:
    """The package's files as a clean clone has them (git's list where there is one)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "furlong"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = []
    found = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*") if p.is_file()]
    found = [f for f in found if "__pycache__" not in f]
    # untracked files of this change count too; deleted ones (listed, gone) do not
    return sorted({f for f in [*listed, *found] if (ROOT / f).is_file()})


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and, built from it, the wheel (as ``python -m build`` does), from a copy of
    the tree: setuptools writes build/ and egg-info beside its sources."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the dev extra's `build` is not installed (make install)")
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("dist")
    for name in ["pyproject.toml", "README.md", *_source_files()]:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out


def test_the_wheel_carries_every_module_and_every_runtime_file(dist: Path) -> None:
    (wheel,) = dist.glob("furlong-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("furlong/")}
    modules = {f for f in _source_files() if f.endswith(".py")}
    assert shipped == modules | {f"furlong/{name}" for name in FILES}


def test_the_sdist_carries_every_runtime_file(dist: Path) -> None:
    (sdist,) = dist.glob("furlong-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    top = f"furlong-{__version__}"
    missing = [n for n in FILES if f"{top}/furlong/{n}" not in names]
    assert not missing, f"the sdist lacks {missing}"
    assert f"{top}/README.md" in names  # the long description


def test_every_data_file_of_the_package_is_listed() -> None:
    """A file beside the modules that FILES does not list would be left out of the wheel's
    checks (and likely of the wheel): every one is listed, every listed one exists."""
    data = {f.removeprefix("furlong/") for f in _source_files() if not f.endswith(".py")}
    assert data == set(FILES)
    assert all(package_file(name).is_file() for name in FILES)
    with pytest.raises(ValueError, match=r"'models/x\.c' is not in furlong\.package_data\.FILES"):
        package_file("models/x.c")


def test_the_metadata_passes_twine_check(dist: Path) -> None:
    if importlib.util.find_spec("twine") is None:
        pytest.fail("the dev extra's `twine` is not installed (make install)")
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2


# ------------------------------------------------------------------ dependencies per door


def _module_file(name: str) -> Path | None:
    """The source of furlong module ``name`` (a dotted name), or None for no such module."""
    base = PACKAGE.joinpath(*name.split(".")[1:])
    return next((p for p in (base / "__init__.py", base.with_suffix(".py")) if p.is_file()), None)


def _load_time_imports(path: Path) -> set[str]:
    """What importing ``path`` imports: its statements outside functions and outside
    ``if TYPE_CHECKING:`` blocks (class bodies and try/if/with blocks run at import)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)  # maybe modules
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.With | ast.ClassDef):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return names


def _third_party(doors: tuple[str, ...]) -> dict[str, str]:
    """The top-level non-furlong, non-stdlib modules the doors load, each with one furlong
    module that imports it (for the message)."""
    seen: set[str] = set()
    todo = [m for door in doors for m in _with_parents(door)]
    found: dict[str, str] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        assert path is not None, f"{module} is not a furlong module"
        for name in _load_time_imports(path):
            top = name.partition(".")[0]
            if top == "furlong":
                todo += [m for m in _with_parents(name) if _module_file(m) is not None]
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, module)
    return found


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _distributions(modules: dict[str, str]) -> dict[str, str]:
    owners = packages_distributions()
    out = {}
    for top, importer in modules.items():
        assert top in owners, f"{importer} imports {top}, which no installed distribution has"
        for dist in owners[top]:
            out[_normal(dist)] = f"{top} (imported by {importer})"
    return out


@pytest.mark.parametrize("door", sorted(DOORS))
def test_each_front_door_loads_only_what_its_install_brings(door: str) -> None:
    allowed = _names(PYPROJECT["dependencies"])
    if door != "core":
        allowed |= _names(PYPROJECT["optional-dependencies"][door])
    used = _distributions(_third_party(DOORS[door]))
    extra = {dist: why for dist, why in used.items() if dist not in allowed}
    assert not extra, f"the {door} door loads undeclared distributions: {extra}"


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_is_exactly_what_its_doors_load(extra: str) -> None:
    """The extra's modules come from the distributions pyproject lists for it, and its doors
    load every one of them (nothing installed that no door needs)."""
    listed = _names(PYPROJECT["optional-dependencies"][extra])
    owners = packages_distributions()
    tops = {module.partition(".")[0] for module in EXTRAS[extra]}
    provided = {_normal(d) for top in tops for d in owners[top]}
    assert provided == listed
    assert tops <= set(_third_party(DOORS[extra]))


def test_the_extras_of_pyproject_are_the_extras_furlong_names() -> None:
    assert set(PYPROJECT["optional-dependencies"]) == {*EXTRAS, "dev"}


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(EXTRAS, "server", ("fastapi", "no_such_module_xyz"))
    with pytest.raises(InputError) as caught:
        require("server", "furlong serve")
    assert str(caught.value) == (
        "furlong serve needs furlong's 'server' extra (no_such_module_xyz not installed): "
        "pip install 'furlong[server]'"
    )
    require("ray", "--ray")  # installed here: no error


def test_ray_placement_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from furlong.rl.config import load_config

    monkeypatch.setitem(EXTRAS, "ray", ("no_such_ray_xyz",))
    with pytest.raises(InputError, match=r"^scale\.ray \(--ray\) needs furlong's 'ray' extra"):
        load_config(None, ["scale.ray=local"])
    load_config(None, [])  # a run without Ray asks nothing of it
