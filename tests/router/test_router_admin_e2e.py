"""The replicas' admin routes through the router: two real replicas of the tiny model (each behind its own
--api-key) and ``kvserve router`` with --admin-key. Sleep, wake, weight updates and LoRA load/unload reach
every replica, the answer lists each one's result, a failure on the replicas comes back with their status
and OpenAI's error body, and a replica that cannot be reached turns the answer into a 502 that says which."""

from __future__ import annotations

import httpx
import pytest

from conftest import tiny_hf_model
from lora_utils import write_adapter
from server_utils import TINY_ENGINE, AppThread, ServerThread

pytest.importorskip("peft")
REPLICA_KEY, ADMIN_KEY = "k", "adm"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, embedded_hf_tokenizer):
    from kvserve.config import KVServeConfig, ServerConfig
    from kvserve.router.app import create_router_app
    from kvserve.router.config import RouterConfig
    from kvserve.server.engine_client import AsyncEngineClient

    root = tmp_path_factory.mktemp("admin")
    for name, seed in (("a", 3), ("b", 5)):  # --weights-dir: one shape, other weights
        tiny_hf_model(vocab=49152, seed=seed).save_pretrained(root / "weights" / name)
        embedded_hf_tokenizer.save_pretrained(root / "weights" / name)
    write_adapter(tiny_hf_model(vocab=49152, seed=3), root / "lora" / "sql", seed=40, r=4)

    def replica(name: str) -> ServerThread:
        client = AsyncEngineClient(KVServeConfig.from_kwargs(
            model=str(root / "weights" / "a"), **TINY_ENGINE, quantization="none", enable_lora=True,
            max_lora_rank=8, lora_dir=str(root / "lora")))
        return ServerThread(client, ServerConfig(served_model_names=["tiny"], replica_id=name, api_key=REPLICA_KEY,
                                                 weights_dir=str(root / "weights")))

    with replica("r1") as r1, replica("r2") as r2:
        config = RouterConfig(backends=[r1.url, r2.url], admin_key=ADMIN_KEY, backend_api_key=REPLICA_KEY,
                              health_interval_s=0.5, events_wait_s=0.5)
        with AppThread(create_router_app(config, None)) as router:
            yield router, (r1, r2)


def on_replicas(replicas, method: str, path: str) -> list[dict]:
    return [httpx.request(method, f"{r.url}{path}", headers={"Authorization": f"Bearer {REPLICA_KEY}"},
                          timeout=30).json() for r in replicas]


def test_admin_routes_reach_every_replica(cluster):
    router, replicas = cluster
    urls = sorted(r.url for r in replicas)
    post = lambda path, **kw: httpx.post(f"{router.url}{path}", headers=ADMIN, timeout=120, **kw)  # noqa: E731

    refused = httpx.post(f"{router.url}/sleep", headers={"Authorization": f"Bearer {REPLICA_KEY}"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert on_replicas(replicas, "GET", "/is_sleeping") == [{"is_sleeping": False}] * 2  # the 401 reached none

    slept = post("/sleep", params={"level": 1})
    assert slept.status_code == 200, slept.text
    assert slept.json()["success"] and sorted(r["replica"] for r in slept.json()["replicas"]) == urls
    assert all(r["status_code"] == 200 and r["body"]["is_sleeping"] for r in slept.json()["replicas"])
    assert on_replicas(replicas, "GET", "/is_sleeping") == [{"is_sleeping": True}] * 2
    assert post("/wake_up").status_code == 200
    assert on_replicas(replicas, "GET", "/is_sleeping") == [{"is_sleeping": False}] * 2

    updated = post("/update_weights_from_disk", json={"model_path": "b"})
    assert updated.status_code == 200 and all(r["body"]["success"] for r in updated.json()["replicas"])

    loaded = post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "sql"})
    assert loaded.status_code == 200, loaded.text
    for models in on_replicas(replicas, "GET", "/v1/models"):
        assert "sql" in {c["id"] for c in models["data"]}
    again = post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "missing"})
    body = again.json()
    assert again.status_code in (400, 404) and body["error"]["message"].startswith("2 of 2 replicas failed")
    assert body["success"] is False and [r["status_code"] for r in body["replicas"]] == [again.status_code] * 2
    assert post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    for models in on_replicas(replicas, "GET", "/v1/models"):
        assert "sql" not in {c["id"] for c in models["data"]}


def test_a_replica_that_cannot_be_reached_is_named_in_a_502(cluster):
    from kvserve.router.app import create_router_app
    from kvserve.router.config import RouterConfig

    _, (r1, _) = cluster
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    config = RouterConfig(backends=[r1.url, dead], admin_key=ADMIN_KEY, backend_api_key=REPLICA_KEY,
                          health_interval_s=0.5, connect_timeout_s=1.0)
    with AppThread(create_router_app(config, None)) as router:
        resp = httpx.post(f"{router.url}/wake_up", headers=ADMIN, timeout=60)
    body = resp.json()
    assert resp.status_code == 502 and body["error"]["code"] == "replicas_failed"
    assert "1 of 2 replicas failed" in body["error"]["message"] and dead in body["error"]["message"]
    by_url = {r["replica"]: r for r in body["replicas"]}
    assert by_url[r1.url]["status_code"] == 200 and by_url[dead]["status_code"] is None
