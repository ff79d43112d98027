"""Scale-out on Ray Serve: kvserve replicas as a Ray Serve deployment behind one OpenAI ingress.

``kvserve serve --ray`` (``launch.py``) or ``serve run`` on ``kvserve.ray_serve.app:build_app``
(``app.py``). The ingress (``ingress.py``) tokenizes each generation request once and calls a replica
through a deployment handle; which replica is decided by ``CacheAwareRequestRouter``
(``request_router.py``), kvserve's routing policy (``kvserve.router.policy``) as a Ray Serve
``RequestRouter``, from what each replica reports of its prefix cache (``replica.py``). A replica is
kvserve's own server (the FastAPI app over an engine process), driven in-process (``call.py``).
Nothing here is imported unless Ray is installed (``pip install 'kvserve[ray]'``).
"""
