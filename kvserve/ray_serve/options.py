"""How kvserve runs on Ray Serve (``RayServeOptions``): replicas, autoscaling, CPUs, routing; the ``--ray-*`` flags.

No Ray import at module level: ``kvserve serve`` builds its flags from here whether or not Ray is installed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidArgumentError
from kvserve.router.policy import DEFAULT_MAX_IMBALANCE, POLICIES

ROUTER_CLASS = "kvserve.ray_serve.request_router:CacheAwareRequestRouter"


@dataclass
class RayServeOptions:
    """How many replicas, what each one gets, and how requests are routed among them."""

    num_replicas: int = 2
    max_replicas: int | None = None  # above num_replicas: autoscale between the two
    target_ongoing_requests: float = 4.0  # autoscaling: requests per replica it aims at
    num_cpus: float = 1.0  # Ray's CPUs per replica (give --num-threads the same)
    max_ongoing_requests: int = 64  # requests one replica takes at once (Ray queues the rest)
    policy: str = "cache-aware"
    max_load_imbalance: int = DEFAULT_MAX_IMBALANCE
    routing_stats_period_s: float = 1.0  # how often replicas report their caches to the router

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgumentError(f"the routing policy must be one of {', '.join(POLICIES)}", param="policy")
        if self.num_replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.num_replicas):
            raise InvalidArgumentError("need 1 <= num_replicas <= max_replicas", param="num_replicas")
        if self.num_cpus < 0 or self.max_ongoing_requests < 1 or self.routing_stats_period_s <= 0:
            raise InvalidArgumentError("num_cpus must be >= 0, max_ongoing_requests >= 1 and "
                                       "routing_stats_period_s > 0", param="num_cpus")

    def replica_options(self) -> dict[str, Any]:
        """The ``KVServeReplica`` deployment's options."""
        from ray.serve.config import RequestRouterConfig

        scale: dict[str, Any] = {"num_replicas": self.num_replicas}
        if self.max_replicas is not None and self.max_replicas > self.num_replicas:
            scale = {"autoscaling_config": {"min_replicas": self.num_replicas, "max_replicas": self.max_replicas,
                                            "target_ongoing_requests": self.target_ongoing_requests}}
        return {**scale, "ray_actor_options": {"num_cpus": self.num_cpus},
                "max_ongoing_requests": self.max_ongoing_requests,
                "request_router_config": RequestRouterConfig(
                    request_router_class=ROUTER_CLASS,
                    request_router_kwargs={"policy": self.policy, "max_load_imbalance": self.max_load_imbalance},
                    request_routing_stats_period_s=self.routing_stats_period_s)}


def add_args(p: argparse.ArgumentParser) -> None:
    """``kvserve serve``'s Ray flags (used only with ``--ray``)."""
    d = RayServeOptions()
    g = p.add_argument_group("ray", "scale-out on Ray Serve (docs/scale-out.md); needs `pip install 'ray[serve]'`")
    g.add_argument("--ray", action="store_true", help="serve on Ray Serve: --ray-replicas replicas of this server "
                   "behind one OpenAI endpoint on --host/--port, routed by their prefix caches")
    g.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local one)")
    g.add_argument("--ray-replicas", type=int, default=d.num_replicas, help="replicas (default: %(default)s)")
    g.add_argument("--ray-max-replicas", type=int, default=None,
                   help="autoscale between --ray-replicas and this many, by requests in flight")
    g.add_argument("--ray-cpus-per-replica", type=float, default=d.num_cpus,
                   help="Ray CPUs each replica takes (default: %(default)s; set --num-threads to match)")
    g.add_argument("--ray-policy", default=d.policy, choices=POLICIES,
                   help="how the request router picks a replica, as `kvserve router --policy` (default: %(default)s)")


def from_args(a: argparse.Namespace) -> RayServeOptions:
    return RayServeOptions(num_replicas=a.ray_replicas, max_replicas=a.ray_max_replicas,
                           num_cpus=a.ray_cpus_per_replica, policy=a.ray_policy)
