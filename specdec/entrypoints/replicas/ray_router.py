"""``SpecdecRequestRouter``: the replica router as a Ray Serve 2.60 custom request router.

Ray Serve gives it the live replicas and the pending call; the ingress passes the request's
routing text and session as the call's first argument, so the router reads no request body. The
decision is ``router.Router``'s, the one the ``--data-parallel-size`` front makes (as Ray's
``PrefixCacheAffinityRouter``, whose shape this follows, but a tree per router in-process rather
than a shared tree actor: one ingress replica sees every request). A ``/v1/responses`` call's
route names its caller instead (``tenant``): it goes to the caller's replica by rendezvous
hashing over the live replicas, whatever their loads, since its stored responses live there.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.entrypoints.replicas.router import Router, RouterConfig, rendezvous


class SpecdecRequestRouter(RequestRouter):
    """Prefix affinity, ``x-session-id`` rendezvous hashing, least load when imbalanced; a
    tenant's ``/v1/responses`` calls to its own replica."""

    def initialize_state(
        self, imbalanced_threshold: int = 10, match_rate_threshold: float = 0.1
    ) -> None:
        self._router = Router(RouterConfig(imbalanced_threshold, match_rate_threshold))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        route: Any = pending_request.args[0] if pending_request and pending_request.args else None
        if not isinstance(route, dict):
            return [candidate_replicas]
        if route.get("tenant"):  # /v1/responses: where the caller's stored responses live
            ids = sorted(r.replica_id.unique_id for r in candidate_replicas)
            chosen = rendezvous(route["tenant"], ids)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == chosen]]
        probed = await self._probe_queue_lens(candidate_replicas, 0)
        known = [q for _, q in probed if q is not None]
        # NOTE: a replica whose probe did not answer in time (a loaded host) stays a candidate at
        # the highest known load: dropping it would move its sessions and prefixes elsewhere.
        unknown = max(known, default=0)
        loads = {
            r.replica_id.unique_id: unknown if q is None else q
            for r, q in probed
            if q is None or q < r.max_ongoing_requests
        }
        if not loads:
            return [candidate_replicas]
        choice = self._router.choose(
            route.get("text", ""), route.get("session"), loads, route.get("salt")
        )
        return [[r for r in candidate_replicas if r.replica_id.unique_id == choice.replica]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._router.reset(replica_id.unique_id)
