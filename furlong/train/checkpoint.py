"""Training checkpoints: safetensors weights + optimizer state, written atomically.

Layout of a checkpoint directory::

    model.safetensors       kind "model": the model's state dict (tied tensors stored once);
                            kind "params": only the trained parameters, keyed by the engine's
                            names (e.g. one LoRA adapter, without the shared base weights)
    optimizer.safetensors   every tensor of the optimizer state, keyed "<param name>.<key>"
    training_state.json     format, kind, step, parameter order, param groups, scalar state,
                            optimizer kind ("adamw" | "muon"), and the caller's ``info``
                            (e.g. base model and LoRA config)

Format v1 (no kind, no info) is read as kind "model"; a checkpoint without an optimizer kind
holds AdamW state. Loading reads and checks everything before it changes the model or the
optimizer. File-backed optimizer state (``furlong.train.filemap``) is msynced before writing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from furlong.errors import InputError
from furlong.models.loading import atomic_dir, publish_dir
from furlong.shapes import check_names_and_shapes
from furlong.train import filemap
from furlong.train.composite import CompositeOptimizer

FORMAT = "furlong-train-state-v2"
READABLE_FORMATS = ("furlong-train-state-v1", FORMAT)
KIND_MODEL = "model"  # the whole state dict
KIND_PARAMS = "params"  # a named subset of parameters
TUPLE_KEYS = ("betas", "ns_coefficients")  # param-group tuples that JSON stores as lists


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Unique tensors by storage, plus ``alias -> stored name`` for tied ones."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int], str] = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen and t.numel():
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    return tensors, aliases


def save_training_state(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | CompositeOptimizer,
    param_names: list[str],
    step: int,
    *,
    params: Sequence[torch.Tensor] | None = None,
    masters: Mapping[str, torch.Tensor] | None = None,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """``params`` given: store only those (kind "params"), else the whole model, with the fp32
    ``masters`` of its bf16 parameters (by name) in place of their rounded values."""
    if params is None:
        tensors, aliases = _model_tensors(model)
        for name, master in (masters or {}).items():
            tensors[aliases.get(name, name)] = master.contiguous().cpu()
    else:
        tensors = {
            n: p.detach().contiguous().cpu().clone()
            for n, p in zip(param_names, params, strict=True)
        }
        aliases = {}
    opt = optimizer.state_dict()
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_scalars: dict[str, dict[str, Any]] = {}
    for idx, state in opt["state"].items():
        name = param_names[idx]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                opt_tensors[f"{name}.{key}"] = value.detach().contiguous().cpu()
            else:
                opt_scalars.setdefault(name, {})[key] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        | {"params": [param_names[i] for i in g["params"]]}
        for g in opt["param_groups"]
    ]
    meta = {
        "format": FORMAT,
        "kind": KIND_MODEL if params is None else KIND_PARAMS,
        "info": dict(info or {}),
        "step": step,
        "param_names": param_names,
        "param_groups": groups,
        "optimizer_class": type(optimizer).__name__,
        "optimizer_kind": getattr(optimizer, "kind", "adamw"),
        "scalar_state": opt_scalars,
        "aliases": aliases,
    }
    filemap.sync(opt_tensors.values())  # dirty mapped pages reach the disk before we write
    tmp, final = atomic_dir(path)
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "training_state.json").write_text(json.dumps(meta, indent=1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
    return final


def read_training_state(path: str | os.PathLike) -> tuple[dict, dict, dict]:
    """``(model tensors, optimizer tensors, meta)``; raises InputError on anything unreadable."""
    root = Path(path)
    files = [
        root / n for n in ("model.safetensors", "optimizer.safetensors", "training_state.json")
    ]
    for f in files:
        if not f.is_file():
            raise InputError(
                f"path: {root} is not a furlong training checkpoint ({f.name} missing)"
            )
    meta = read_meta(root)
    return load_file(str(files[0])), load_file(str(files[1])), meta


def read_meta(path: str | os.PathLike) -> dict:
    """``training_state.json`` of a checkpoint, checked and with v1 defaults filled in."""
    root = Path(path)
    try:
        meta = json.loads((root / "training_state.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"path: {root} is not a furlong training checkpoint ({e})") from e
    if meta.get("format") not in READABLE_FORMATS:
        raise InputError(f"path: {root} has format {meta.get('format')!r}, expected {FORMAT!r}")
    meta.setdefault("kind", KIND_MODEL)
    meta.setdefault("info", {})
    return meta


def check_kind(meta: dict, kind: str) -> None:
    if meta["kind"] != kind:
        what = {KIND_MODEL: "a whole model", KIND_PARAMS: "a parameter subset (an adapter)"}
        raise InputError(
            f"checkpoint holds {what.get(meta['kind'], repr(meta['kind']))}, "
            f"this model trains {what[kind]}"
        )


def check_info(meta: dict, expected: Mapping[str, Any]) -> None:
    """Every key of ``expected`` must equal the saved ``info`` (JSON values: lists, not tuples)."""
    for key, want in expected.items():
        got = meta["info"].get(key)
        if got != want:
            raise InputError(f"checkpoint was saved for {key} {got!r}, this model has {want!r}")


def check_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected, _ = _model_tensors(model)
    check_tensors(expected, tensors)


def check_tensors(
    expected: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Same names and shapes as ``expected``."""
    check_names_and_shapes(tensors, expected, "checkpoint does not match the model")


def safetensors_bytes(path: str | os.PathLike) -> int:
    """The tensor bytes of a safetensors file, from its header alone (8-byte length, JSON)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(
        e["data_offsets"][1] - e["data_offsets"][0]
        for k, e in header.items()
        if k != "__metadata__"
    )


def restore_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor], aliases: dict) -> None:
    full = dict(tensors) | {alias: tensors[name] for alias, name in aliases.items()}
    model.load_state_dict(full, strict=True)


def restore_params(
    names: Sequence[str], params: Sequence[torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> None:
    for name, p in zip(names, params, strict=True):
        p.copy_(tensors[name])


def optimizer_kind(meta: dict) -> str:
    return meta.get("optimizer_kind", "adamw")  # before optimizer kinds: always AdamW


def optimizer_state_dict(
    meta: dict, opt_tensors: dict[str, torch.Tensor], names: list[str], kind: str | None = None
) -> dict[str, Any]:
    """Rebuild ``optimizer.state_dict()`` in this process's parameter order; ``kind`` given:
    the optimizer kind it is for."""
    if kind is not None and optimizer_kind(meta) != kind:
        raise InputError(
            f"checkpoint holds {optimizer_kind(meta)} optimizer state, this engine uses {kind} "
            "(load with optimizer=False to take only the weights)"
        )
    if meta["param_names"] != names:
        raise InputError("checkpoint optimizer state was saved for different parameters")
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in opt_tensors.items():
        name, _, field = key.rpartition(".")
        state.setdefault(index[name], {})[field] = value
    for name, scalars in meta["scalar_state"].items():
        state.setdefault(index[name], {}).update(scalars)
    groups = []
    for g in meta["param_groups"]:
        group = {k: (tuple(v) if k in TUPLE_KEYS else v) for k, v in g.items() if k != "params"}
        groups.append(group | {"params": [index[n] for n in g["params"]]})
    return {"state": state, "param_groups": groups}
