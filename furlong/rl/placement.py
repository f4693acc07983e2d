"""Where Ray puts trainer ranks and rollout engines: one placement group, one bundle per device.

``separate``: every trainer rank and every rollout engine has a bundle of its own (one
device each: a CPU slot, or a GPU). ``colocated``: trainer rank *i* and rollout engine *i*
share bundle *i*, each asking for half of it (on GPUs: two processes on one device, the
engine's memory handed over around training as in ``furlong.rl.handoff``). Pure planning
here; ``furlong.rl.ray_actors`` creates the group and the actors.
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.errors import InputError


@dataclass(frozen=True)
class Placement:
    bundles: list[dict[str, float]]  # the placement group's bundles
    trainers: list[int]  # bundle index of each trainer rank
    engines: list[int]  # bundle index of each rollout engine
    share: float  # the fraction of its bundle each actor asks for

    def resources(self, bundle: int) -> dict[str, float]:
        """What one actor on ``bundle`` asks for."""
        return {k: v * self.share for k, v in self.bundles[bundle].items()}


def plan(trainer_ranks: int, engines: int, colocate: bool, gpus: bool = False) -> Placement:
    """``gpus``: one GPU per bundle (with one CPU), else one CPU."""
    for name, value in (("trainer_ranks", trainer_ranks), ("rollout_engines", engines)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"scale.{name}: must be an integer >= 1, got {value!r}")
    device = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
    if colocate:
        count = max(trainer_ranks, engines)
        return Placement(
            [dict(device) for _ in range(count)],
            list(range(trainer_ranks)),
            list(range(engines)),
            0.5,
        )
    bundles = [dict(device) for _ in range(trainer_ranks + engines)]
    engine_bundles = list(range(trainer_ranks, trainer_ranks + engines))
    return Placement(bundles, list(range(trainer_ranks)), engine_bundles, 1.0)
