"""The Ray Serve application: kvserve replicas behind the OpenAI ingress (``build``, and ``build_app`` for ``serve run``).

Two deployments: ``KVServeReplica`` (the engines: ``num_replicas`` or an ``autoscaling_config``,
``ray_actor_options.num_cpus`` each, routed by ``CacheAwareRequestRouter``) and ``KVServeIngress``
(the FastAPI ingress: tokenizes, calls a replica, streams back). ``kvserve serve --ray`` builds it
from its flags; ``serve run`` builds it from a config file whose ``args`` are kvserve's settings by
their Python-API names (``dtype: float32``, ``num_threads: 1``, ...) plus this module's
``RayServeOptions`` fields, and whose ``deployments`` section may override any deployment option
(docs/scale-out.md has one).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ray import serve

from kvserve.config import KVServeConfig
from kvserve.ray_serve.ingress import KVServeIngress
from kvserve.ray_serve.options import RayServeOptions
from kvserve.ray_serve.replica import KVServeReplica

REPLICA_DEPLOYMENT = "KVServeReplica"  # the names a serve config's `deployments` section uses
INGRESS_DEPLOYMENT = "KVServeIngress"

def build(config: KVServeConfig, options: RayServeOptions | None = None) -> serve.Application:
    """The application: ``options``' replicas of kvserve's server with ``config``, behind the ingress."""
    options = options or RayServeOptions()
    replicas = serve.deployment(KVServeReplica, name=REPLICA_DEPLOYMENT).options(**options.replica_options())
    ingress = serve.deployment(KVServeIngress, name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1024)
    return ingress.bind(replicas.bind(config), config.model.model, config.server.tool_call_parser,
                        config.server.max_request_bytes)


def build_app(args: dict[str, Any]) -> serve.Application:
    """``serve run``'s builder: ``args`` are kvserve settings (``KVServeConfig.from_kwargs`` names) and
    ``RayServeOptions`` fields, flat."""
    args = dict(args or {})
    names = {f.name for f in fields(RayServeOptions)}
    options = RayServeOptions(**{k: args.pop(k) for k in list(args) if k in names})
    return build(KVServeConfig.from_kwargs(**args), options)

