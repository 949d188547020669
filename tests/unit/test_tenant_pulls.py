"""Where the node pulls a tenant's image (``pull_network``, service/_policy.py): from a
namespace that reaches only public addresses, whatever the tenant sends; from the node's
network only for a registry the operator listed. What "public" holds against on a real
registry: tests/test_pull_network.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ray_sandbox.runtime.config import SandboxConfig, make_config
from ray_sandbox.service._policy import TenantPolicy, admit

NODES = ("192.0.2.10",)
NAMES = {"registry.example": ["93.184.216.34"], "mirror.internal": ["10.1.2.3"]}


def run(given: dict[str, Any], policy: TenantPolicy | None = None) -> SandboxConfig:
    return admit(policy or TenantPolicy(), {"image": "ray-sandbox/busybox", **given},
                 lambda o: make_config(**o), NODES, lambda host: NAMES.get(host, []))


def test_the_runtime_pulls_from_the_nodes_network_unless_asked():
    assert SandboxConfig().pull_network == "node"
    assert SandboxConfig(pull_network="public").pull_network == "public"
    with pytest.raises(ValidationError):
        SandboxConfig(pull_network="host")


@pytest.mark.parametrize("image", ["registry.example/x:1", "python:3.12-slim",
                                   "ray-sandbox/busybox"])
def test_a_tenants_pull_reaches_only_public_addresses(image):
    assert run({"image": image}).pull_network == "public"


def test_a_tenant_cannot_pull_from_the_nodes_network():
    with pytest.raises(HTTPException) as info:
        run({"image": "registry.example/x:1", "pull_network": "node"})
    assert info.value.status_code == 400
    assert str(info.value.detail).startswith("pull_network:"), info.value.detail
    assert "operator's" in str(info.value.detail)


@pytest.mark.parametrize("image", ["127.0.0.1:5000/x", "mirror.internal:5000/x"])
def test_a_listed_registry_is_pulled_from_the_nodes_network(image):
    """The operator trusts a listed registry, where it redirects to included (a mirror
    whose blobs are on an internal object store): it is pulled as before."""
    policy = TenantPolicy(registries=["127.0.0.1:5000", "mirror.internal:5000"])
    assert run({"image": image}, policy).pull_network == "node"
    assert run({"image": "registry.example/x:1"}, policy).pull_network == "public"


def test_the_operator_may_pull_every_tenants_image_from_the_nodes_network():
    assert run({"image": "registry.example/x:1"},
               TenantPolicy(pull_network="node")).pull_network == "node"
