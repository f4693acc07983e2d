"""The engine's optimizer: torch optimizers over disjoint parameter sets (its "parts": AdamW,
and Muon for hidden matrices) plus one optimizer-state store (memory or disk).

``state_dict()`` numbers parameters in the engine's order, whichever part owns them: the
layout ``checkpoint.py`` writes (``"<param name>.<key>"``). ``load_state_dict`` takes it back,
so save → load → step continues bit-identically.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from furlong.errors import InputError
from furlong.train.offload import DiskStore, MemoryStore


class _State(Mapping):
    """``optimizer.state`` across the parts, keyed by parameter. Indexing a parameter creates
    its (empty) entry in the owning part, as torch's defaultdict does; ``get`` does not."""

    def __init__(self, owners: dict[int, torch.optim.Optimizer]):
        self._owners = owners

    def _parts(self) -> list[torch.optim.Optimizer]:
        return list({id(o): o for o in self._owners.values()}.values())

    def __getitem__(self, p: torch.Tensor) -> dict:
        part = self._owners.get(id(p))
        if part is None:
            raise KeyError("not a parameter of this optimizer")
        return part.state[p]

    def __contains__(self, p: object) -> bool:
        part = self._owners.get(id(p))
        return part is not None and p in part.state

    def get(self, p: torch.Tensor, default: Any = None) -> Any:
        part = self._owners.get(id(p))
        if part is None or p not in part.state:
            return default
        return part.state[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for part in self._parts():
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts())


class CompositeOptimizer:
    """``kind`` ("adamw" | "muon") names the recipe; every parameter belongs to one part."""

    def __init__(
        self,
        kind: str,
        params: Sequence[torch.Tensor],
        parts: Sequence[torch.optim.Optimizer],
        store: MemoryStore | DiskStore,
    ):
        self.kind = kind
        self.parts = list(parts)
        self.store = store
        position = {id(p): i for i, p in enumerate(params)}
        self._index = [  # per part: its local parameter order -> the engine's index
            [position[id(p)] for g in part.param_groups for p in g["params"]] for part in parts
        ]
        owners = {id(p): part for part in parts for g in part.param_groups for p in g["params"]}
        if sum(map(len, self._index)) != len(params) or owners.keys() != position.keys():
            raise ValueError("CompositeOptimizer: every parameter must belong to exactly one part")
        self.state = _State(owners)

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    def step(self) -> None:
        self.store.step(self.parts)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, dict] = {}
        groups: list[dict] = []
        for part, index in zip(self.parts, self._index, strict=True):
            sd = part.state_dict()  # local indices: the part's parameters in group order
            state.update({index[i]: s for i, s in sd["state"].items()})
            groups += [g | {"params": [index[i] for i in g["params"]]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Checked whole before any part changes; the store places the loaded state."""
        groups = list(state_dict["param_groups"])
        ours = self.param_groups
        if len(groups) != len(ours):
            raise InputError(
                f"optimizer state has {len(groups)} parameter groups, this {self.kind} "
                f"optimizer has {len(ours)} (saved with another optimizer?)"
            )
        start = 0
        per_part = []
        for part, index in zip(self.parts, self._index, strict=True):
            saved = groups[start : start + len(part.param_groups)]
            start += len(part.param_groups)
            if [i for g in saved for i in g["params"]] != index or any(
                g.get("kind", "adamw") != o.get("kind", "adamw")
                for g, o in zip(saved, part.param_groups, strict=True)
            ):
                raise InputError(
                    f"optimizer state does not match this {self.kind} optimizer's assignment "
                    "of parameters (saved with another optimizer?)"
                )
            local = {gi: li for li, gi in enumerate(index)}
            state = {local[i]: s for i, s in state_dict["state"].items() if i in local}
            saved = [g | {"params": [local[i] for i in g["params"]]} for g in saved]
            per_part.append({"state": state, "param_groups": saved})
        for part, sd in zip(self.parts, per_part, strict=True):
            self.store.load_state(part, sd)
