"""--cpu-bind: CPU lists and NUMA nodes parsed and checked in one line, replicas given disjoint cores node by
node, and an engine process whose threads run on the CPUs it was given."""

from __future__ import annotations

import os

import pytest

from kvserve.cpu_bind import format_cpu_list, parse_cpu_list, resolve_cpu_bind, split_for_replicas
from kvserve.errors import InvalidArgumentError


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 8, 10]) == "0-2,8,10-11"
    for bad in ("x", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_resolve_names_what_is_wrong_in_one_line():
    mine = sorted(os.sched_getaffinity(0))
    assert resolve_cpu_bind(None) is None and resolve_cpu_bind("none") is None and resolve_cpu_bind("auto") is None
    assert resolve_cpu_bind(str(mine[0])) == [mine[0]]
    assert resolve_cpu_bind("numa:0") and set(resolve_cpu_bind("numa:0")) <= set(mine)
    for spec, why in (("0-x", "expected a CPU list"), ("4096", "not available here"), ("numa:99", "NUMA nodes")):
        with pytest.raises(InvalidArgumentError, match=why) as e:
            resolve_cpu_bind(spec)
        assert "\n" not in str(e.value)


def test_replicas_get_disjoint_cores_node_by_node():
    two_nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_for_replicas(2, two_nodes) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_for_replicas(4, two_nodes) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # none spans two nodes
    assert split_for_replicas(3, two_nodes) == [[0, 1], [2, 3, 4], [5, 6, 7]]  # not a multiple: contiguous
    with pytest.raises(InvalidArgumentError, match="need a CPU each"):
        split_for_replicas(9, two_nodes)


def test_replica_configs_pin_each_replica_to_its_cores(monkeypatch):
    import kvserve.cpu_bind
    import kvserve.router.replicas as replicas
    from kvserve.config import KVServeConfig

    monkeypatch.setattr(kvserve.cpu_bind, "available_cpus", lambda: list(range(8)))  # an 8-CPU, 2-node machine
    monkeypatch.setattr(replicas, "split_for_replicas", lambda n: split_for_replicas(n, [[0, 1, 2, 3], [4, 5, 6, 7]]))
    configs = replicas.replica_configs(KVServeConfig.from_kwargs(cpu_bind="auto"), 2, cores=8)
    assert [(c.model.cpu_bind, c.model.num_threads) for c in configs] == [("0-3", 4), ("4-7", 4)]
    assert "--cpu-bind" in configs[0].to_cli_args()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_engine_process_runs_on_the_cpus_it_was_given(tiny_model_dir):
    from kvserve.config import KVServeConfig
    from kvserve.server.engine_client import AsyncEngineClient
    from server_utils import TINY_ENGINE

    cpu = sorted(os.sched_getaffinity(0))[-1]
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), **TINY_ENGINE, cpu_bind=str(cpu)))
    try:
        status = open(f"/proc/{client._proc.pid}/status").read()
        allowed = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        assert allowed.split()[-1] == str(cpu)
        assert os.sched_getaffinity(0) != {cpu}  # the API process itself stays unpinned
    finally:
        client.shutdown()
