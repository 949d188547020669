"""The tenant policy (service/_policy.py), pure: every SandboxConfig field has a rule, and
each hostile option a probe sent as a tenant is refused with the field and the rule, or
replaced by what the operator decided. The same rules on the real service:
tests/test_service_tenants.py."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.exceptions import HTTPException

from ray_sandbox.runtime.config import DEFAULT_DISK, SandboxConfig, make_config
from ray_sandbox.service import _policy
from ray_sandbox.service._policy import TenantPolicy, admit, parse_policies

NODES = ("192.0.2.10", "192.0.2.11")  # the cluster's nodes (TEST-NET-1)
NAMES = {"registry.example": ["93.184.216.34"], "sneaky.example": ["127.0.0.1"],
         "inside.example": ["10.1.2.3"], "meta.example": ["169.254.169.254"],
         "node.example": ["192.0.2.11"]}


def make(options: dict[str, Any]) -> SandboxConfig:
    # the Ray layer's defaults: a writable root unless asked otherwise
    return make_config(**{"readonly": False, **options})


def run(given: dict[str, Any], policy: TenantPolicy | None = None) -> SandboxConfig:
    return admit(policy or TenantPolicy(), {"image": "ray-sandbox/busybox", **given}, make,
                 NODES, lambda host: NAMES.get(host, []))


def refused(given: dict[str, Any], field: str, policy: TenantPolicy | None = None) -> str:
    with pytest.raises(HTTPException) as info:
        run(given, policy)
    assert info.value.status_code == 400
    message = str(info.value.detail)
    assert message.startswith(f"{field}:"), message
    return message


def test_every_config_field_has_a_rule():
    """A new SandboxConfig option is refused for tenants until the policy names it."""
    assert set(_policy.RULES) == set(SandboxConfig.model_fields)
    assert all(_policy.describe().values())


def test_an_option_without_a_rule_is_refused(monkeypatch):
    monkeypatch.delitem(_policy.RULES, "shell")
    with pytest.raises(HTTPException) as info:
        run({"shell": "/bin/sh"})
    assert "shell: no tenant policy covers this option" in str(info.value.detail)


@pytest.mark.parametrize("cidrs", [["0.0.0.0/0"], ["192.0.2.11/32"], ["127.0.0.1/32"],
                                   ["10.0.0.0/8"], ["169.254.169.254/32"], ["::/0"]])
def test_egress_toward_the_node_private_ranges_or_loopback_is_refused(cidrs):
    msg = refused({"network": "public", "egress": {"allow_cidrs": cidrs}}, "egress")
    assert "allow_cidrs" in msg


def test_egress_to_public_ranges_is_kept_and_every_node_denied():
    out = run({"network": "sandbox", "egress": {"allow_cidrs": ["151.101.0.0/16"],
                                                "allow_domains": ["pypi.org"]}})
    eg = out.egress
    assert eg.allow_cidrs == ("151.101.0.0/16",)
    assert {"192.0.2.10/32", "192.0.2.11/32"} <= set(eg.deny_cidrs)
    assert eg.private_domains is False  # names open no internal service either
    assert run({"network": "public"}).egress.deny_cidrs == ("192.0.2.10/32", "192.0.2.11/32")
    assert run({"network": "none"}).egress is None


def test_the_operator_may_open_a_private_range():
    policy = TenantPolicy(egress_cidrs=["10.9.0.0/16"], private_domains=True)
    out = run({"network": "public", "egress": {"allow_cidrs": ["10.9.1.0/24"]}}, policy)
    assert out.egress.allow_cidrs == ("10.9.1.0/24",)
    assert out.egress.private_domains is True
    refused({"network": "public", "egress": {"allow_cidrs": ["10.8.0.0/16"]}}, "egress",
            policy)


@pytest.mark.parametrize("field,value", [("rootless", True), ("platform", "systrap"),
                                         ("directfs", False)])
def test_runtime_settings_are_the_operators(field, value):
    assert "operator's" in refused({field: value}, field)
    wanted = getattr(TenantPolicy(), field)
    assert getattr(run({field: wanted}), field) == wanted
    # the operator's choice applies to every create, whatever the tenant left out
    assert run({}, TenantPolicy(directfs=False)).directfs is False


@pytest.mark.parametrize("pids", [None, 4194304, 5000])
def test_pids_limit_is_bounded(pids):
    refused({"pids_limit": pids}, "pids_limit")


def test_pids_limit_auto_and_within_bounds_pass():
    assert run({"pids_limit": 512}).pids_limit == 512
    assert run({}).pids_limit == "auto"
    assert run({}, TenantPolicy(pids_max=1024)).pids_limit == 1024  # auto may give 4096


@pytest.mark.parametrize("disk", ["unlimited", "1Ti"])
def test_disk_is_always_capped(disk):
    refused({"disk": disk}, "disk")


@pytest.mark.parametrize("given", [{}, {"disk": None}, {"readonly": True, "workdir": "/w"}])
def test_a_missing_disk_gets_the_policys_default(given):
    out = run(given, TenantPolicy(disk_default="64Mi"))
    assert out.disk == 64 << 20
    assert out.effective_disk in (None, 64 << 20)
    assert run(given).disk == DEFAULT_DISK


@pytest.mark.parametrize("dns", [["127.0.0.1"], ["10.213.0.7"], ["8.8.8.8"]])
def test_dns_resolvers_are_the_operators(dns):
    refused({"network": "public", "dns": dns}, "dns")


def test_a_listed_resolver_passes():
    out = run({"network": "public", "dns": ["9.9.9.9"]}, TenantPolicy(dns=["9.9.9.9"]))
    assert out.dns == ("9.9.9.9",)


def test_capabilities_beyond_dockers_set_are_refused():
    every = sorted(_policy.SandboxConfig._caps(["CAP_SYS_ADMIN", "CAP_NET_ADMIN"]))
    assert "CAP_SYS_ADMIN" in refused({"capabilities": every}, "capabilities")
    assert run({"capabilities": ["CAP_CHOWN"]}).capabilities == ("CAP_CHOWN",)
    refused({"docker": True, "memory": "512Mi"}, "docker")
    out = run({"docker": True, "memory": "512Mi"}, TenantPolicy(docker=True))
    assert out.docker is True


@pytest.mark.parametrize("image", [
    "127.0.0.1:5000/x", "localhost:1/x", "[::1]:5000/x", "sneaky.example/x",
    "inside.example:443/x", "meta.example/x", "node.example:6379/x", "192.0.2.10:8265/x",
])
def test_registries_on_the_nodes_side_are_refused_alike(image):
    msg = refused({"image": image}, "image")
    assert "tenants may not pull from" in msg  # one answer: no port scanner


def test_public_and_listed_registries_pass():
    assert run({"image": "registry.example/x:1"}).image == "registry.example/x:1"
    assert run({"image": "python:3.12-slim"}).image == "python:3.12-slim"
    policy = TenantPolicy(registries=["127.0.0.1:5000"])
    assert run({"image": "127.0.0.1:5000/x"}, policy).image == "127.0.0.1:5000/x"


def test_host_paths_need_the_operator():
    refused({"image": "oci:/var/lib/ray_sandbox/images/x:latest"}, "image")
    refused({"image": "localhost/lab/task:v1"}, "image")  # a Dockerfile build of the node
    run({"image": "oci:/srv/x:latest"}, TenantPolicy(host_images=True))


def test_host_network_ttl_ports_labels():
    refused({"network": "host"}, "network")
    run({"network": "host"}, TenantPolicy(network_modes=["none", "host"]))
    policy = TenantPolicy(max_ttl_seconds=600)
    assert run({}, policy).ttl_seconds == 600
    refused({"ttl_seconds": 601}, "ttl_seconds", policy)
    refused({"network": "public", "expose_ports": list(range(1, 18))}, "expose_ports")
    refused({"labels": {"ray-sandbox/service-tenant": "bob"}}, "labels")
    refused({"memory": "2Gi"}, "memory", TenantPolicy(max_memory="1Gi"))
    refused({"memory": 0}, "memory")  # unlimited: nothing to count against a quota


def test_a_policy_file_gives_defaults_and_per_tenant_overrides(tmp_path):
    text = ('{"default": {"disk_max": "8Gi", "dns": ["9.9.9.9"]},'
            ' "tenants": {"ops": {"network_modes": ["none", "host"]}}}')
    policies = parse_policies(text, "test")
    assert policies["*"].disk_max == 8 << 30
    assert policies["ops"].network_modes == ("none", "host")
    assert policies["ops"].dns == ("9.9.9.9",)  # the default's, under the override
    with pytest.raises(Exception, match="bad tenant policy"):
        parse_policies('{"default": {"no_such": 1}}', "test")


def test_the_security_docs_show_every_rule_as_the_code_has_it():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    for field, rule in _policy.describe().items():
        assert f"| `{field}` | {rule} |" in text, field


@pytest.mark.parametrize("cidr", ["::ffff:0:0/96", "64:ff9b::/96", "2002::/16",
                                  "198.18.0.0/15", "::ffff:127.0.0.1/128"])
def test_egress_to_ranges_that_lead_elsewhere_is_refused(cidr):
    """IPv4 inside IPv6 (mapped, NAT64, 6to4) and the benchmarking range were accepted."""
    refused({"network": "public", "egress": {"allow_cidrs": [cidr]}}, "egress")


def test_published_ports_stay_within_the_policys_range():
    """A published port is the node's: a tenant's port 22 or 8265 stood in for the node's."""
    refused({"network": "sandbox", "expose_ports": [22]}, "expose_ports")
    assert run({"network": "sandbox", "expose_ports": [8080]}).expose_ports == (8080,)
    refused({"network": "sandbox", "expose_ports": [8080]}, "expose_ports",
            TenantPolicy(port_range=(20000, 30000)))


def test_inject_names_only_secrets_the_service_put_in_the_tenants_scope():
    """The service maps a tenant's secret names into its scope before the policy runs
    (service/_secrets.py); a name left unmapped, the operator's or another scope's shape,
    is refused."""
    rule = {"domain": "api.example", "headers": {"Authorization": "Bearer $K"}}
    egress = {"allow_domains": ["api.example"]}
    mapped = {**rule, "secret": "t-0123456789abcdef/api"}
    out = run({"network": "public", "egress": {**egress, "inject": [mapped]}})
    assert out.egress.inject[0].secret == "t-0123456789abcdef/api"
    for name in ("api", "t-api", "other/api", "t-0123456789abcdeX/api"):
        msg = refused({"network": "public",
                       "egress": {**egress, "inject": [{**rule, "secret": name}]}}, "egress")
        assert "is not one of the tenant's" in msg
    static = {"domain": "api.example", "headers": {"X-Trace": "t1"}}  # no secret: any tenant
    assert run({"network": "public", "egress": {**egress, "inject": [static]}}).egress.inject
