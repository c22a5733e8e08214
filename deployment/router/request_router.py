"""Serve's request router for the engine deployment with `fleet_routing: kv` (deployment/router/fleet_view.py).

Only the class, on purpose: Serve pickles the module of a router class given by path *by value* into every
handle's process, so anything defined here would be a private copy there. What the router shares with the
ingress's follower (the `FleetView`) lives in fleet_view, and the `GenerateRequest` the ingress sends in
engine/messages.py, both imported by reference.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployment.router.fleet_view import fleet_view, place, routed_of, went_to
from engine.config import load_weight_for
from engine.ranks import resolve_device


class KVFleetRouter(RequestRouter):
    """No FIFOMixin: a replica chosen for one request (and the dp group written on it) must not serve another."""

    def initialize_state(self, primary_weight: float = 1.0, host_weight: float = 0.5,
                         load_weight: float | None = None, free_weight: float = 1.0) -> None:
        """The `kv` score's weights; an unset load weight (`device=auto`) by the device the ranks get."""
        if load_weight is None:
            load_weight = load_weight_for(None, resolve_device("auto"))
        self.weights = (primary_weight, host_weight, load_weight, free_weight)
        self.view = fleet_view(self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.view.set_live(frozenset(r.replica_id.unique_id for r in replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.set_live(self.view.live - {replica_id.unique_id})

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # as Serve's own routers do once they offer every replica: when none of the ranks takes the request (all
        # full), Serve pauses before asking again instead of looping at once
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get("replica")
        if target is not None:  # a follower's call: to that replica; while it is not here, any one answers
            # that it is not the one (on an empty choice Serve's routing task would ask again at once, for good)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target] or candidate_replicas]
        routed = routed_of(pending_request)
        if routed is None:
            return [candidate_replicas]  # Serve takes the one with the shortest queue
        t0, cpu0 = time.perf_counter(), time.thread_time()
        ranks = place(self.view, self.weights, candidate_replicas, routed)
        self.view.decision_s.append(time.perf_counter() - t0)
        self.view.decision_cpu_s.append(time.thread_time() - cpu0)  # its own CPU: the rest is waiting for the GIL
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Serve's word on the replica that accepted the request, which may not be the one `place` chose."""
        routed = routed_of(pending_request)
        if routed is not None:
            went_to(self.view, routed, replica_id.unique_id)
