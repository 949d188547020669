"""Credential injection through the service: a tenant's secrets are stored on the nodes in a
scope of its own, injected into its own sandboxes' requests only, never shown, and revoked at
once. Real service, real Ray, real runsc, and real HTTPS upstreams in the fake internet
(tests/fx_inject.py); the rule itself: tests/unit/test_tenant_policy.py."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import httpx
import pytest

from ray_sandbox.service._policy import TenantPolicy
from ray_sandbox.service._secrets import scope
from tests.fx_inject import TEST_DNS, Upstreams
from tests.fx_network import NODE
from tests.fx_service import Service, wait_exec, wait_running

SERVICE_SETTINGS = {"policies": {"*": TenantPolicy(dns=list(TEST_DNS))}}


@pytest.fixture(scope="module", autouse=True)
def cluster_egress(https_upstream: Upstreams) -> Iterator[None]:
    """Before the module's Ray cluster starts (its hosts inherit this environment): the
    sandboxes' egress leaves through the fake internet, their proxies trust its CA."""
    env = {"RAY_SANDBOX_NET_UPSTREAM": NODE, "RAY_SANDBOX_NET_INJECT_CA": str(
        https_upstream.ca_file)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _body(secret: str) -> dict:
    return {"image": "ray-sandbox/python", "cpu": 0.5, "memory": "256Mi", "network": "public",
            "dns": list(TEST_DNS), "egress": {"allow_domains": ["api.test"], "inject": [
                {"domain": "api.test", "headers": {"Authorization": "Bearer $TOKEN"},
                 "secret": secret}]}}


def _create(c: httpx.Client, body: dict) -> str:
    r = c.post("/sandboxes", json=body)
    assert r.status_code == 202, r.text
    sid = r.json()["sandbox_id"]
    info = wait_running(c, sid)
    assert info["status"] == "running", info
    return sid


def _get(c: httpx.Client, sid: str, path: str) -> str:
    code = ("import urllib.request as u, urllib.error as e\n"
            "try: print(u.urlopen('https://api.test" + path + "', timeout=30).status)\n"
            "except e.HTTPError as x: print(x.code, x.read().decode())")
    r = c.post(f"/sandboxes/{sid}/execs", json={"command": ["python3", "-c", code]})
    assert r.status_code == 202, r.text
    done = wait_exec(c, sid, r.json()["exec_id"])
    return done["stdout"].strip()


def test_a_tenants_secret_is_injected_for_its_own_sandboxes_only(service: Service,
                                                                  https_upstream: Upstreams):
    https_upstream.clear()
    alice, bob = service.client("alice"), service.client("bob")
    a_key, b_key = secrets.token_hex(20), secrets.token_hex(20)
    assert alice.put("/secrets/api", json={"values": {"TOKEN": a_key}}).status_code == 204
    assert bob.put("/secrets/api", json={"values": {"TOKEN": b_key}}).status_code == 204
    assert alice.get("/secrets").json() == {"secrets": ["api"]}  # names, never values
    mine, theirs = _create(alice, _body("api")), _create(bob, _body("api"))
    try:
        assert _get(alice, mine, "/alice") == "200"
        assert _get(bob, theirs, "/bob") == "200"
        assert [s.headers["authorization"] for s in https_upstream.requests("api.test")] == \
            [[f"Bearer {a_key}"], [f"Bearer {b_key}"]]

        # bob can name neither alice's secret (by its name on the nodes) nor one he lacks
        for name in (f"{scope('alice')}/api", "nope"):
            r = bob.post("/sandboxes", json=_body(name))
            assert r.status_code == 400, r.text
            assert "no secret" in r.json()["error"]["message"]
        assert bob.post("/sandboxes", json=_body("../api")).status_code == 400

        # alice deletes hers: her sandbox's next request is refused, bob's goes on
        assert alice.delete("/secrets/api").status_code == 204
        out = _get(alice, mine, "/alice-again")
        assert out.startswith("502") and "not available" in out
        assert https_upstream.requests("api.test", "/alice-again") == []
        assert _get(bob, theirs, "/bob-again") == "200"
        assert alice.get("/secrets").json() == {"secrets": []}
    finally:
        for c, sid in ((alice, mine), (bob, theirs)):
            c.delete(f"/sandboxes/{sid}")
        bob.delete("/secrets/api")
    audit = service.audit_log.read_text()
    assert "/api/v1/secrets/api" in audit  # each put and delete has its line ...
    assert a_key not in audit and b_key not in audit  # ... without the values


def test_secret_names_and_values_are_checked(service: Service):
    alice = service.client("alice")
    for name, body, status in [
        ("x" * 65, {"values": {"K": "v"}}, 400),
        ("ok", {"values": {"K": "line\nbreak"}}, 400),
        ("ok", {"values": {}}, 400),
        ("ok", {"values": {"K": "v"}, "extra": 1}, 400),
    ]:
        r = alice.put(f"/secrets/{name}", json=body)
        assert r.status_code == status, (name, body, r.text)
    assert alice.get("/secrets").json() == {"secrets": []}
