"""The router's policies on Ray Serve: :class:`SpecdistRequestRouter`, a ``ray.serve.request_router.RequestRouter``.

Serve calls ``choose_replicas(candidate_replicas, pending_request)`` for each request; each candidate's
``routing_stats`` is the dict its replica's ``record_routing_stats`` last returned
(:meth:`specdist.api.router.ReplicaStats.to_dict`, ``reported_at`` on ``time.time()``). What the router
knows of the request comes from the caller: the ingress passes :meth:`RouteRequest.to_dict` as the
keyword argument ``specdist_route`` of the handle call (a request without it is routed by load alone);
its session may also come from Serve's ``metadata.session_id``. The answer ranks the chosen replica first
and the others after it, so Serve falls back to them when the chosen one's queue is full. A request counts on
the chosen replica from the choice on (moved if Serve sends it to another), so that the next choice, made
before Serve has heard back from that replica, sees it.

Deployment options: ``request_router_config=RequestRouterConfig(request_router_class=SpecdistRequestRouter,
request_router_kwargs={"router": RouterConfig fields as a dict, "block_size": engine.kv_block_size})``
and ``request_routing_stats_period_s`` below ``router.stats_period_s``. Importing this module imports Ray
Serve; nothing else in ``specdist`` imports it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from specdist.api.router import ReplicaStats, Router, RouteRequest, session_key
from specdist.config import RouterConfig, build_section

__all__ = ["ROUTE_KWARG", "SpecdistRequestRouter"]

ROUTE_KWARG = "specdist_route"  # the handle call's keyword argument carrying RouteRequest.to_dict()
MAX_ROUTE_IDS = 65536  # requests in flight whose ids the router maps (far more than a deployment holds)


class SpecdistRequestRouter(FIFOMixin, RequestRouter):
    """Serve's request router running :class:`specdist.api.router.Router` (policy by ``router.policy``)."""

    def initialize_state(
        self, router: dict | None = None, block_size: int = 16, seed: int = 0, tenant: str = "", **_: Any
    ) -> None:
        """``router``: the config's ``router:`` section as a dict (checked as the config checks it)."""
        cfg = build_section(RouterConfig, router or {}, "router")
        cfg.validate("router")
        self.tenant = tenant  # the tenant of requests whose route names none (a one-tenant deployment)
        self.router = Router(cfg, block_size, seed)
        self.seen: dict[str, float] = {}  # replica id -> reported_at of the report taken
        # Serve's request id -> the id the router knows it by (the route's: the key the replica reports it under)
        self.route_ids: OrderedDict[str, str] = OrderedDict()

    def route_request(self, pending_request: PendingRequest | None) -> RouteRequest:
        """The RouteRequest the caller attached (its id: the key its replica reports it under, so that the router
        can read it out of a report once it ended); a session id from Serve's metadata when it has none."""
        meta = getattr(pending_request, "metadata", None)
        internal = getattr(meta, "internal_request_id", "") or str(id(pending_request))
        d = (getattr(pending_request, "kwargs", None) or {}).get(ROUTE_KWARG)
        if d is None:
            return RouteRequest(internal, 0, 0)
        req = RouteRequest.from_dict({"request_id": internal, **d})
        self.route_ids[internal] = req.request_id
        self.route_ids.move_to_end(internal)
        while len(self.route_ids) > MAX_ROUTE_IDS:  # (ids of requests whose end Serve never told: a replica died)
            self.route_ids.popitem(last=False)
        sid = getattr(meta, "session_id", "")
        if not req.session and sid:  # scoped by tenant like every key (specdist.api.router.session_key)
            req = RouteRequest(
                req.request_id,
                req.prompt_tokens,
                req.max_tokens,
                req.prompt_blocks,
                req.kind,
                session_key(str(d.get("tenant", self.tenant)), sid, (), 0),
            )
        return req

    def take_reports(self, replicas: list[RunningReplica]) -> None:
        # (imported here: Serve may ship this class by value, with copies of this module's globals; the module
        # imported at call time is this process's own, where the front doors' observers are)
        from specdist.api import replica_set

        for r in replicas:
            rid = r.replica_id.to_full_id_str()
            stats = r.routing_stats
            if stats and "reported_at" in stats and self.seen.get(rid) != stats["reported_at"]:
                if stats.get("accepting", True):
                    self.router.report(ReplicaStats.from_dict(stats, replica_id=rid))
                else:  # its target is down or it drains: no request until it reports again accepting
                    self.router.forget(rid)
                self.seen[rid] = stats["reported_at"]
                for observe in list(replica_set.REPORT_OBSERVERS):
                    observe(rid, stats)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self.take_reports(candidate_replicas)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        avoid = ((getattr(pending_request, "kwargs", None) or {}).get(ROUTE_KWARG) or {}).get("avoid")
        if avoid in by_id and len(by_id) > 1:  # the replica that just failed this request: any other first
            del by_id[avoid]
        # booked now, not once Serve reports it sent (on_request_routed, after the replica's answer): requests
        # arriving together would otherwise all see the same loads and go to the same replica
        chosen = self.router.choose(self.route_request(pending_request), time.time(), list(by_id))
        rest = [r for rid, r in by_id.items() if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Serve sent the request (to the chosen replica, or to one ranked after it): count it there (only)."""
        self.router.book(replica_id.to_full_id_str(), self.route_request(pending_request), time.time())

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        request_id = self.route_ids.pop(internal_request_id, internal_request_id)
        self.router.done(replica_id.to_full_id_str(), request_id, time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of running replicas (with their latest reports: the controller asks each replica every
        stats period and sends the set on): the reports are taken now, not only when a request is routed."""
        super().update_replicas(replicas)
        self.take_reports(list(replicas))

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.forget(replica_id.to_full_id_str())
        self.seen.pop(replica_id.to_full_id_str(), None)
