"""``kvserve serve --replicas``: each replica's share of the machine and its command line (no processes)."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.config import PARTS, KVServeConfig
from kvserve.errors import InvalidArgumentError
from kvserve.router.replicas import ReplicaSet, replica_configs


def config(*flags: str) -> KVServeConfig:
    return KVServeConfig.from_cli_args(build_parser().parse_args(["serve", *flags]), tuple(PARTS))


def test_cli_args_give_the_same_config_back():
    c = config("--dtype", "float32", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--served-model-name",
               "a", "b", "--log-requests", "--kv-cache-memory-gb", "0.5", "--port", "9000", "--load-format", "dummy")
    args = c.to_cli_args(tuple(PARTS))
    assert c.model.load_format == "dummy" and "--load-format" in args  # replicas load dummy weights too
    assert "--port" in args and "--served-model-name" in args and "--no-enable-prefix-caching" in args
    assert config(*args) == c
    assert config(*KVServeConfig().to_cli_args(tuple(PARTS))) == KVServeConfig()
    assert "--port" not in c.to_cli_args(tuple(PARTS), skip=("port",))


def test_resources_are_divided_among_the_replicas(tmp_path):
    c = config("--num-threads", "8", "--kv-cache-memory-gb", "2", "--kv-offload-memory-gb", "1",
               "--kv-offload-dir", str(tmp_path), "--max-num-seqs", "16")
    parts = replica_configs(c, 4)
    assert [p.model.num_threads for p in parts] == [2, 2, 2, 2]
    assert {p.cache.kv_cache_memory_gb for p in parts} == {0.5}
    assert {p.cache.kv_offload_memory_gb for p in parts} == {0.25}
    assert [p.cache.kv_offload_dir for p in parts] == [str(tmp_path / f"replica-{i}") for i in range(4)]
    assert {p.scheduler.max_num_seqs for p in parts} == {16}  # per-engine knobs are each replica's
    # without --num-threads: the cores here
    assert [p.model.num_threads for p in replica_configs(config(), 2, cores=6)] == [3, 3]
    assert [p.cache.num_kv_blocks for p in replica_configs(config("--num-kv-blocks", "100"), 2, cores=2)] == [50, 50]


@pytest.mark.parametrize("n,flags,needle", [
    (0, (), "at least 1"),
    (-2, (), "at least 1"),
    (5, (), "more than the 4 cores"),
    (3, ("--num-threads", "2"), "more than the 2 --num-threads"),
])
def test_bad_replica_counts_are_clear_errors(n, flags, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        replica_configs(config(*flags), n, cores=4)


def test_each_replica_is_a_kvserve_serve_on_loopback_with_the_key_in_its_environment():
    c = config("--dtype", "float32", "--api-key", "s3cret", "--host", "0.0.0.0", "--port", "9000")
    replicas = ReplicaSet(replica_configs(c, 2, cores=2), "svc")
    ports = {r.port for r in replicas.replicas}
    assert len(ports) == 2 and 9000 not in ports
    for i, r in enumerate(replicas.replicas):
        argv = r.argv()
        assert argv[1:4] == ["-m", "kvserve", "serve"]
        parsed = build_parser().parse_args(argv[3:])
        assert (parsed.host, parsed.port, parsed.replica_id, parsed.num_threads) == ("127.0.0.1", r.port, f"svc-{i}", 1)
        assert parsed.dtype == "float32"
        assert "s3cret" not in " ".join(argv) and r.env["KVSERVE_API_KEY"] == "s3cret"


def test_the_routers_admin_routes_need_the_key_serve_replicas_gives_them():
    """With an admin key (serve --replicas sets it to its --api-key) the router's /admin routes need it."""
    import httpx

    from kvserve.router.app import create_router_app
    from kvserve.router.config import RouterConfig
    from server_utils import AppThread

    with AppThread(create_router_app(RouterConfig(admin_key="k"), None)) as r:
        assert httpx.get(f"{r.url}/admin/backends").status_code == 401
        wrong = httpx.get(f"{r.url}/admin/backends", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = httpx.get(f"{r.url}/admin/backends", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json() == {"policy": "cache-aware", "backends": []}
        assert httpx.get(f"{r.url}/health").status_code == 503  # no backend up


def test_a_replica_whose_port_was_taken_meanwhile_starts_on_another(monkeypatch):
    """The free port chosen for a replica can be taken before the replica binds it: it starts again on
    a new one (stand-in replicas: a tiny HTTP server that exits if its port is busy)."""
    import socket
    import sys

    from kvserve.router import replicas as rs

    server = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers()\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    monkeypatch.setattr(rs.Replica, "argv", lambda self: [sys.executable, "-c", server, str(self.port)])
    replicas = ReplicaSet(replica_configs(config(), 2, cores=2), "svc")
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", replicas.replicas[0].port))
    squatter.listen()
    taken = replicas.replicas[0].port
    try:
        replicas.start()
        replicas.wait_ready()
        assert replicas.replicas[0].port != taken
        assert replicas.urls[0] == f"http://127.0.0.1:{replicas.replicas[0].port}"
    finally:
        squatter.close()
        replicas.stop(5)
