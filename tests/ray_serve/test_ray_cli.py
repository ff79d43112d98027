"""``kvserve serve --ray`` without Ray installed is a one-line message naming the package; the Ray flags parse."""

from __future__ import annotations

import sys

import pytest

from kvserve.cli import build_parser, main
from kvserve.ray_serve.options import RayServeOptions, from_args


def test_ray_without_ray_installed_is_one_line_naming_the_package(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as when it is not installed
    assert main(["serve", "--ray", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvserve: error:") and "ray[serve]" in err


def test_ray_flags_become_the_deployment_options():
    args = build_parser().parse_args(["serve", "--ray", "--ray-replicas", "2", "--ray-max-replicas", "4",
                                      "--ray-cpus-per-replica", "1", "--ray-policy", "least-load"])
    options = from_args(args)
    assert (options.num_replicas, options.max_replicas, options.num_cpus, options.policy) == (2, 4, 1.0, "least-load")
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")
    deployment = options.replica_options()
    assert "num_replicas" not in deployment  # autoscaling instead
    assert deployment["autoscaling_config"]["min_replicas"] == 2 and deployment["autoscaling_config"]["max_replicas"] == 4
    assert deployment["ray_actor_options"] == {"num_cpus": 1.0}
    router = deployment["request_router_config"]
    assert router.request_router_class == "kvserve.ray_serve.request_router:CacheAwareRequestRouter"
    assert router.request_router_kwargs["policy"] == "least-load"
    assert RayServeOptions(num_replicas=3).replica_options()["num_replicas"] == 3


@pytest.mark.parametrize("bad", [["--ray-replicas", "0"], ["--ray-replicas", "3", "--ray-max-replicas", "2"]])
def test_bad_ray_flags_are_one_line_errors(bad, capsys):
    assert main(["serve", "--ray", *bad]) == 2
    assert capsys.readouterr().err.startswith("kvserve: error:")


def test_the_documented_serve_config_builds_the_application():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from kvserve.ray_serve.app import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT, build_app

    path = Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))  # Ray Serve's own schema
    (app,) = config.applications
    assert app.import_path == "kvserve.ray_serve.app:build_app"
    assert {d.name for d in app.deployments} == {REPLICA_DEPLOYMENT, INGRESS_DEPLOYMENT}
    built = build_app(app.args)  # kvserve's settings and the routing options are all known names
    assert built._bound_deployment.name == INGRESS_DEPLOYMENT
