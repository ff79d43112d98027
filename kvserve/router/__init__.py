"""``kvserve router``: one OpenAI endpoint in front of several kvserve replicas, routing by their prefix caches.

Each replica publishes what its prefix cache stores and evicts (``GET /kv/events``); the router
mirrors those sets, tokenizes each prompt once, and sends it where most of it is already cached,
within a bound on load imbalance (``policy.py``). ``docs/scale-out.md`` describes running it.
"""
