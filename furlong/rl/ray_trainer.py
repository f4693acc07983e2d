"""Trainer ranks as Ray actors: the same ranks as :class:`~furlong.train.group.TrainerGroup`
(each a :class:`~furlong.train.group.RankWorker`), placed on placement-group bundles, joined
over TCP at rank 0's node, behind the same TrainingEngine API."""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from furlong.rl.placement import Placement
from furlong.train.group import GroupAPI, RankSpec, RankWorker, loopback_interface

LOCAL = "local"  # start a Ray instance on this host, on loopback


def connect(address: str, num_cpus: int) -> None:
    """``local``: start Ray here on 127.0.0.1 with ``num_cpus`` logical CPUs (one per actor
    at least: with fewer, actors wait forever); else join the cluster at ``address``
    (``auto`` or ``host:port``)."""
    if ray.is_initialized():
        return
    if address == LOCAL:
        ray.init(
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
        )
    else:
        ray.init(address=address, log_to_driver=False)


def create_placement_group(placement: Placement) -> PlacementGroup:
    """One group for the run; PACK keeps bundles on as few nodes as fit."""
    group = placement_group(placement.bundles, strategy="PACK")
    ray.get(group.ready())
    return group


def on_bundle(group: PlacementGroup, bundle: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)


@ray.remote(num_cpus=0)
def _rendezvous_address() -> str:
    """A free TCP port on the node of bundle 0 (where rank 0 runs), as ``tcp://ip:port``."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


class RankActor:
    """One trainer rank in a Ray actor."""

    def __init__(self, spec: RankSpec, rank: int, world_size: int, init_method: str):
        lo = loopback_interface()
        if "://127.0.0.1:" in init_method and lo is not None:  # a one-host loopback cluster
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ["LOCAL_RANK"] = "0"  # Ray gives each GPU actor one visible device
        self.worker = RankWorker(spec, rank, world_size, init_method)

    def ready(self) -> bool:
        return True

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return self.worker.call(method, args, kwargs)


class RayTrainerGroup(GroupAPI):
    """N trainer ranks on ``placement.trainers`` bundles of ``group``."""

    def __init__(self, spec: RankSpec, placement: Placement, group: PlacementGroup):
        world = len(placement.trainers)
        where = [on_bundle(group, b) for b in placement.trainers]
        init = ray.get(_rendezvous_address.options(scheduling_strategy=where[0]).remote())
        self.world_size = world
        self.placement_group = group  # removed by close(), after the engines on it are gone
        self.actors: list[Any] = []  # Ray actor handles (Any: see ray_rollout.Actor)
        for rank, bundle in enumerate(placement.trainers):
            need = placement.resources(bundle)
            actor = ray.remote(RankActor).options(
                num_cpus=need.get("CPU", 0),
                num_gpus=need.get("GPU", 0),
                scheduling_strategy=where[rank],
            )
            self.actors.append(actor.remote(spec, rank, world, init))
        ray.get([a.ready.remote() for a in self.actors])
        self.param_names: list[str] = self._call("param_names")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.call_refs(method, *args, **kwargs))[0]

    def weights(self) -> ray.ObjectRef:
        """Rank 0's whole weights, left in Ray's object store: the Ray rollout engines read
        them from there, nothing passes through the driver. The gather is a collective, so
        every rank takes part."""
        refs = self.call_refs("full_weights")
        ray.get(refs[1:])
        return refs[0]

    def call_refs(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Every rank's result as object refs (rank 0's first); nothing waits."""
        return [a.call.remote(method, args, kwargs) for a in self.actors]

    def close(self) -> None:
        """Stop the ranks and release the placement group (close the engines on it first)."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        remove_placement_group(self.placement_group)
