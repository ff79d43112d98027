"""deploy/k8s/kvserve.yaml (untested on a cluster here): it parses, its pieces fit together, and every
container's args are flags kvserve's own command line takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvserve.cli import build_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "kvserve.yaml"


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def parse(c: dict):
    """The container's command line, parsed by kvserve's argparse ($(VAR) as Kubernetes would expand it)."""
    assert c["command"] == ["kvserve"]
    args = [re.sub(r"\$\((\w+)\)", "expanded", a) for a in c["args"]]
    try:
        return build_parser().parse_args(args)
    except SystemExit as e:  # argparse's way to reject a flag
        pytest.fail(f"kvserve rejects {args}: exit {e.code}")


def test_the_manifest_has_replicas_a_headless_service_and_the_router(objects):
    assert set(objects) == {("Service", "kvserve-replicas"), ("StatefulSet", "kvserve-replica"),
                            ("Deployment", "kvserve-router"), ("Service", "kvserve")}
    headless = objects["Service", "kvserve-replicas"]
    sts = objects["StatefulSet", "kvserve-replica"]
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "kvserve-replicas"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == pod_labels
    assert headless["spec"]["selector"] == pod_labels
    router = objects["Deployment", "kvserve-router"]
    assert objects["Service", "kvserve"]["spec"]["selector"] == router["spec"]["template"]["metadata"]["labels"]


def test_container_args_are_kvserve_flags_and_probes_hit_health(objects):
    sts = objects["StatefulSet", "kvserve-replica"]
    replica = parse(container(sts))
    assert replica.command == "serve" and replica.host == "0.0.0.0" and replica.replica_id == "expanded"
    assert container(sts)["ports"][0]["containerPort"] == replica.port
    assert replica.num_threads == int(container(sts)["resources"]["requests"]["cpu"])

    router = parse(container(objects["Deployment", "kvserve-router"]))
    assert router.command == "router" and router.policy == "cache-aware"
    # one --backend per StatefulSet pod, by its stable DNS name through the headless service
    assert router.backends == [f"http://kvserve-replica-{i}.kvserve-replicas:{replica.port}"
                               for i in range(sts["spec"]["replicas"])]
    for obj in (sts, objects["Deployment", "kvserve-router"]):
        c = container(obj)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert {"requests", "limits"} <= set(c["resources"])
