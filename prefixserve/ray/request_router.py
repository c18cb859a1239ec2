"""Our kv_aware policy as a Ray Serve request router (Ray's custom RequestRouter interface, Ray >= 2.46).

Every DeploymentHandle to the engine deployment (the ingress's) routes with one of these. For each
request it builds a `ReplicaCacheView` per candidate replica, fed by the replica's routing stats
(the keys it holds, reported every `routing_stats_period_s`) and by what this router sent it since
(keys expected, work outstanding), and asks `policies.KVAware` which replica starts it soonest. It
answers Serve with ranks: the policy's choice first, then the rest by load, so a replica at its
`max_ongoing_requests` passes the request on instead of queueing it. A replica the request already
failed on (its node went away) is ranked last.
"""

from __future__ import annotations

import logging
from typing import Optional

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ..router.costs import CostModel, policy_options_for
from ..router.policy_registry import make_policy
from .asgi_call import ForwardedRequest
from .replica_views import ReplicaCacheView, RouteEstimate, ranked

logger = logging.getLogger("prefixserve.ray")


def forwarded_of(pending_request: Optional[PendingRequest]) -> Optional[ForwardedRequest]:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ForwardedRequest):
            return arg
    return None


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "kv_aware", **cost: float) -> None:
        """request_router_kwargs: the policy (any of `prefixserve route --policy`'s) and CostModel fields."""
        self.cost = CostModel(**cost)
        self.policy = make_policy(policy, policy_options_for(self.cost))
        self.views: dict[ReplicaID, ReplicaCacheView] = {}

    def _view(self, replica: RunningReplica) -> ReplicaCacheView:
        view = self.views.get(replica.replica_id)
        if view is None:
            view = self.views[replica.replica_id] = ReplicaCacheView(replica.replica_id.to_full_id_str(), self.cost)
        view.take_report(replica.routing_stats)
        return view

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        views = [self._view(replica) for replica in candidate_replicas]
        forwarded = forwarded_of(pending_request)
        estimate = forwarded.route if forwarded is not None else None
        route = estimate.route if isinstance(estimate, RouteEstimate) else None
        if route is not None:
            best = self.policy.choose(route, views)
        else:
            best = min(range(len(views)), key=lambda i: views[i].load)
        avoid = frozenset(forwarded.avoid) if forwarded is not None else frozenset()
        return [[candidate_replicas[i]] for i in ranked(views, best, avoid)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        view = self.views.get(replica_id)
        forwarded = forwarded_of(pending_request)
        if forwarded is not None:
            forwarded.routed_to = replica_id.to_full_id_str()  # the ingress avoids it if the request fails there
        if view is not None and forwarded is not None and isinstance(forwarded.route, RouteEstimate):
            view.routed(pending_request.metadata.internal_request_id, forwarded.route)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        view = self.views.get(replica_id)
        if view is not None:
            view.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {replica.replica_id for replica in replicas}
        for replica_id in [r for r in self.views if r not in current]:
            del self.views[replica_id]
        for replica in replicas:
            self._view(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.views.pop(replica_id, None)
