"""Multi-rank training state through ``torch.distributed.checkpoint`` (DCP), and full weights.

A checkpoint directory holds DCP's shard files and ``.metadata`` plus ``furlong_state.json``
(format, kind, step, parameter order, optimizer param groups and scalar state, the caller's
``info``). DCP stores every tensor by name with its global shape, so a checkpoint written by
N ranks loads on M ranks: each rank reads the pieces of its own shards. The directory is
written beside the target and renamed into place by rank 0 after every rank has finished; all
ranks must see the same filesystem (a shared one across hosts).

Optimizer state is keyed ``optim.<param name>.<key>``; a state tensor shaped like its
parameter is loaded sharded like the parameter, anything else (AdamW's ``step``) whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from furlong.errors import InputError
from furlong.models.loading import atomic_dir, publish_dir, save_hf_dir
from furlong.shapes import check_names_and_shapes

FORMAT = "furlong-dcp-state-v1"
META = "furlong_state.json"
T = TypeVar("T")


def on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and hand its result (or its exception) to every rank, so no rank
    waits forever on a rank-0 failure."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (fn(), None)
        except Exception as exc:  # re-raised on every rank below
            box[0] = (None, exc)
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / META).is_file()


def saved_optimizer_kind(path: str | os.PathLike) -> str:
    """The optimizer kind of a checkpoint of either format (single-process or DCP)."""
    if is_dcp_checkpoint(path):
        return read_meta(path)["optimizer_kind"]
    from furlong.train import checkpoint as ckpt

    return ckpt.optimizer_kind(ckpt.read_meta(path))


def read_meta(path: str | os.PathLike) -> dict:
    root = Path(path)
    try:
        meta = json.loads((root / META).read_text())
    except (OSError, ValueError) as e:
        raise InputError(
            f"path: {root} is not a multi-rank (DCP) furlong checkpoint ({META}: {e})"
        ) from e
    if meta.get("format") != FORMAT:
        raise InputError(f"path: {root} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state gathered on CPU on rank 0 (a collective; other ranks get
    ``{}``). A model's state is tensors; torch types it as any state-dict value."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return cast(dict[str, torch.Tensor], full)


def full_weights(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``names`` gathered whole on CPU on rank 0 (a collective; other ranks get ``{}``)."""
    full = _full_state(model)
    return {n: full[n] for n in names} if full else {}


def save_state(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    param_names: list[str],
    step: int,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Every rank writes its shards into a temporary directory; rank 0 adds the metadata and
    renames it into place."""
    tmp, final = on_rank0(lambda: atomic_dir(path))
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    fields: dict[str, list[str]] = {}
    for idx, state in opt["state"].items():
        name = param_names[idx]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{key}"] = value
                fields.setdefault(name, []).append(key)
            else:
                scalars.setdefault(name, {})[key] = value
    meta = {
        "format": FORMAT,
        "kind": "model",
        "info": dict(info or {}),
        "step": step,
        "param_names": param_names,
        "param_groups": [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            | {"params": [param_names[i] for i in g["params"]]}
            for g in opt["param_groups"]
        ],
        "optimizer_kind": getattr(optimizer, "kind", "adamw"),
        "optim_tensors": fields,
        "scalar_state": scalars,
        "world_size": dist.get_world_size(),
    }
    try:
        dcp.save({"model": model.state_dict(), "optim": tensors}, checkpoint_id=str(tmp))
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def publish() -> Path:
        (tmp / META).write_text(json.dumps(meta, indent=1))
        publish_dir(tmp, final)
        return final

    return on_rank0(publish)


def load_state(
    path: str | os.PathLike,
    model: torch.nn.Module,
    param_names: list[str],
    params: Sequence[torch.Tensor],
    optimizer: bool,
    expect_info: Mapping[str, Any] | None,
) -> tuple[dict | None, int]:
    """Load the weights into ``model`` in place; return ``(optimizer state_dict or None,
    step)``. Kind, info, names and shapes are checked on every rank before anything loads."""
    root = Path(path)
    meta = read_meta(root)
    for key, want in (expect_info or {}).items():
        got = meta["info"].get(key)
        if got != want:
            raise InputError(f"checkpoint was saved for {key} {got!r}, this model has {want!r}")
    if meta["param_names"] != list(param_names):
        raise InputError("checkpoint parameters do not match this model's")
    if optimizer and meta["optimizer_kind"] != "adamw":
        raise InputError(
            f"checkpoint holds {meta['optimizer_kind']} optimizer state, this engine uses adamw "
            "(load with optimizer=False to take only the weights)"
        )
    saved = dcp.FileSystemReader(str(root)).read_metadata().state_dict_metadata
    weights = model.state_dict()
    sizes = {k: getattr(v, "size", ()) for k, v in saved.items()}  # only tensors have one
    stored = {k.removeprefix("model."): s for k, s in sizes.items() if k.startswith("model.")}
    check_names_and_shapes(stored, weights, "checkpoint does not match the model")
    targets: dict[str, Any] = {"model": weights}
    index = {n: i for i, n in enumerate(param_names)}
    if optimizer:
        opt: dict[str, torch.Tensor] = {}
        for name, keys in meta["optim_tensors"].items():
            p = params[index[name]]
            for key in keys:
                entry = saved[f"optim.{name}.{key}"]
                assert isinstance(entry, TensorStorageMetadata)  # saved from a tensor
                dtype = entry.properties.dtype
                if tuple(entry.size) == tuple(p.shape):  # sharded like the parameter
                    opt[f"{name}.{key}"] = torch.zeros_like(p.detach(), dtype=dtype)
                else:
                    opt[f"{name}.{key}"] = torch.zeros(tuple(entry.size), dtype=dtype)
        targets["optim"] = opt
    dcp.load(targets, checkpoint_id=str(root))
    model.load_state_dict(weights)
    if not optimizer:
        return None, 0
    state: dict[int, dict[str, Any]] = {}
    for key, value in targets["optim"].items():
        name, _, field = key.rpartition(".")
        state.setdefault(index[name], {})[field] = value
    for name, values in meta["scalar_state"].items():
        state.setdefault(index[name], {}).update(values)
    groups = [
        {k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
        | {"params": [index[n] for n in g["params"]]}
        for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}, int(meta["step"])


def export_hf(path: str | os.PathLike, model: torch.nn.Module, tokenizer: Any) -> Path:
    """Gather the full weights on rank 0 and write a normal HF directory from there."""
    full = _full_state(model)

    def write() -> Path:
        dtype = next(t.dtype for t in full.values() if t.is_floating_point())
        plain = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
        plain.load_state_dict(full)
        plain.generation_config = model.generation_config
        return save_hf_dir(plain, tokenizer, path)

    return on_rank0(write)


def unsharded(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
