"""HF ``datasets`` as a task source: ``task.name = "datasets:<file, directory or cached name>"``.

What it loads, offline (the load runs with ``datasets``' offline switch on, so it never
waits on the network):

- a ``.parquet``, ``.jsonl`` / ``.json`` or ``.csv`` file;
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a
  directory of data files (``train.parquet``, ``test.jsonl``, ...);
- a hub name already in the local HF cache (``openai/gsm8k``, config ``main``: write
  ``datasets:openai/gsm8k@main``).

Each row becomes a problem: ``task.prompt_field`` (or ``task.template`` filled with the row's
fields) is the user's message, ``task.answer_field`` the reference, and the row itself the
problem's ``metadata``. A ``test`` (or ``validation``) split is held out; a dataset with one
split holds out a stable tenth by a hash of the prompt. Held-out prompts the train split also
has are dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import datasets.config

from furlong.errors import InputError
from furlong.rl.tasks import Problem, stably_held_out

PREFIX = "datasets:"  # task_sources.DATASETS
FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
HELD_OUT_SPLITS = ("test", "validation", "eval")
HELD_OUT_SHARE = 0.1


def source(name: str) -> tuple[str, str | None]:
    """(path or hub name, config name or None) from ``datasets:<where>[@config]``."""
    where = name.removeprefix(PREFIX)
    if "@" in where and not Path(where).exists():
        where, _, config = where.rpartition("@")
        return where, config
    return where, None


def check(name: str) -> None:
    where, _ = source(name)
    if not where:
        raise InputError("task.name: 'datasets:' needs a file, a directory or a dataset name")
    path = Path(where)
    if path.is_file() and path.suffix not in FILE_BUILDERS:
        raise InputError(
            f"task.name: {where!r}: unknown file type {path.suffix!r}; expected one of "
            f"{sorted(FILE_BUILDERS)}"
        )


def build(
    name: str,
    prompt_field: str,
    answer_field: str,
    template: str,
    check_template: Callable[[set[str]], None],
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) of a checked name (:func:`check`)."""
    splits = _load(name)
    columns = set(next(iter(splits.values())).column_names)
    for field, column in (("task.prompt_field", prompt_field), ("task.answer_field", answer_field)):
        if column not in columns and not (field == "task.prompt_field" and template):
            raise InputError(f"{field}: no column {column!r} in {name}; it has {sorted(columns)}")
    if template:
        check_template(columns)

    def problem(row: dict[str, Any]) -> Problem:
        prompt = template.format(**row) if template else str(row[prompt_field])
        return Problem(prompt, str(row[answer_field]), metadata=row)

    held_name = next((s for s in HELD_OUT_SPLITS if s in splits), None)
    train_name = "train" if "train" in splits else next(s for s in splits if s != held_name)
    train = [problem(r) for r in splits[train_name]]
    if held_name is None:  # one split: a stable tenth held out
        rows = train
        train = [p for p in rows if not stably_held_out(p.prompt, HELD_OUT_SHARE)]
        held = [p for p in rows if stably_held_out(p.prompt, HELD_OUT_SHARE)]
    else:
        held = [problem(r) for r in splits[held_name]]
    asked = {p.prompt for p in train}
    held = [p for p in held if p.prompt not in asked]
    if not train or not held:
        raise InputError(f"task.name: {name} needs both train and held-out rows")
    return train, held


def _load(name: str) -> dict[str, Any]:
    """Split name -> ``datasets.Dataset``, without the network."""
    where, config = source(name)
    path = Path(where)
    with _offline():
        return _splits(where, config, path)


def _splits(where: str, config: str | None, path: Path) -> dict[str, Any]:
    try:
        if path.is_file():
            loaded = datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
        elif path.is_dir() and any(
            (path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")
        ):
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(where, config)
    except Exception as e:  # not cached, unreadable, a bad schema: say where it looked
        raise InputError(
            f"task.name: cannot load {where!r} offline ({type(e).__name__}: {e}); give a "
            "parquet / JSONL / CSV file, a save_to_disk directory or a name in the HF cache"
        ) from e
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """``datasets``' offline switch on for one load (read at its import from
    ``HF_HUB_OFFLINE``; set here without touching the process's environment)."""
    was = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = was
