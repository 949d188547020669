"""kuberay/rayservice.yaml, offline like the other manifests (tests/test_kuberay.py, whose
strict CRD validator and object rules it reuses): the RayService CRD schema, Kubernetes
object rules, the same cluster as raycluster.yaml, and a Serve config that builds the app."""

from __future__ import annotations

import copy
import importlib

import pytest
import yaml

from ray_sandbox.service import ServiceConfig
from tests.test_kuberay import (
    SHARED,
    cel_fields,
    crd_version,
    manifest,
    object_rule_errors,
    schema_errors,
)

CRD = SHARED / "ray.io_rayservices.yaml"
TOKEN_ENV = "RAY_SANDBOX_API_TOKENS"

needs_crd = pytest.mark.skipif(not CRD.is_file(), reason=f"{CRD} not found")


def rayservice() -> dict:
    return manifest("rayservice.yaml")


def serve_config() -> dict:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def app_args() -> dict:
    (app,) = serve_config()["applications"]
    return app["args"]


@needs_crd
def test_rayservice_matches_the_crd_schema_and_uses_no_cel_fields():
    doc = rayservice()
    crd = yaml.safe_load(CRD.read_text())
    assert doc["kind"] == "RayService" == crd["spec"]["names"]["kind"]
    assert schema_errors(doc, crd) == []
    schema = crd_version(crd, doc["apiVersion"])["schema"]["openAPIV3Schema"]
    assert list(cel_fields(doc, schema)) == []


def test_rayservice_follows_kubernetes_object_rules():
    doc = rayservice()
    as_cluster = {"kind": "RayCluster", "metadata": doc["metadata"],
                  "spec": doc["spec"]["rayClusterConfig"]}
    assert object_rule_errors(as_cluster) == []


def test_its_cluster_is_raycluster_yaml_plus_the_api_port_tokens_and_books():
    cluster = copy.deepcopy(rayservice()["spec"]["rayClusterConfig"])
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    # the books' SQLite file (the default state_db) on a claim of its own, in the head's home
    (volume,) = head_pod.pop("volumes")
    claim = manifest("service-state-pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim"
    assert volume == {"name": "service-state",
                      "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    (mount,) = head_pod["containers"][0].pop("volumeMounts")
    assert mount == {"name": "service-state", "mountPath": "/var/lib/ray_sandbox/service"}
    pods = [cluster["headGroupSpec"]["template"]["spec"],
            *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])]
    for pod in pods:  # every node may run the app's build task: all get the tokens
        env = pod["containers"][0]["env"]
        (secret,) = [e for e in env if e["name"] == TOKEN_ENV]
        assert secret["valueFrom"]["secretKeyRef"]["name"] == "ray-sandbox-api-tokens"
        env.remove(secret)
        if not env:  # the head had no environment of its own
            del pod["containers"][0]["env"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    port = serve_config()["http_options"]["port"]
    head["ports"].remove({"containerPort": port, "name": "serve"})
    head["ports"].remove({"containerPort": app_args()["modal_port"], "name": "modal"})
    assert cluster == manifest("raycluster.yaml")["spec"]


def test_its_serve_config_builds_the_app(monkeypatch):
    cfg = serve_config()
    assert cfg["http_options"]["host"] == "0.0.0.0"
    (app,) = cfg["applications"]
    assert app["route_prefix"] == "/"
    module, _, name = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), name)
    monkeypatch.setenv(TOKEN_ENV, "team-a=tok-aaaaaaaaaa,team-b=tok-bbbbbbbbbb")
    built = builder(app["args"])
    (config,) = built._bound_deployment.init_args
    assert isinstance(config, ServiceConfig) and set(config.tokens) == {"team-a", "team-b"}
    assert config.quota("team-a").sandboxes == 50
    assert (config.modal_port, config.modal_host) == (50051, "0.0.0.0")
