"""Credential injection, the pure parts: rules in the config, the secret store and its
templates, and what the egress proxy parses (ClientHello, HTTP/1.1 heads and framing), masks
and checks. End to end with runsc: tests/test_inject.py."""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_sandbox.runtime import bundle, secrets
from ray_sandbox.runtime.config import EgressPolicy, boot_key, covers, make_config
from ray_sandbox.runtime.errors import ConfigError, ProxyRefusal
from ray_sandbox.runtime.network import http1, inject, policy
from ray_sandbox.runtime.network.http1 import Masker, client_hello_sni, framing
from ray_sandbox.runtime.network.inject import Policy

RULE = {"domain": "api.test", "headers": {"Authorization": "Bearer $TOKEN"}, "secret": "api"}


# --- rules in the config -------------------------------------------------------------------


def test_a_rule_names_an_allowed_domain_and_a_secret_for_its_keys():
    eg = EgressPolicy(allow_domains=["api.test"], inject=[RULE])
    assert eg.inject[0].headers == {"Authorization": "Bearer $TOKEN"}
    static = EgressPolicy(allow_domains=["*.corp.test"],
                          inject=[{"domain": "x.corp.test", "headers": {"X-Trace": "t$$1"}}])
    assert static.inject[0].secret is None


@pytest.mark.parametrize(("egress", "says"), [
    ({"allow_domains": ["a.test"], "inject": [{**RULE, "domain": "b.test"}]},
     "not in allow_domains"),
    ({"allow_domains": ["a.test"], "inject": [{**RULE, "domain": "a.test", "secret": None}]},
     "give the secret="),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "headers": {"Host": "x"}}]},
     "frames or routes"),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "headers": {"Proxy-Foo": "x"}}]},
     "frames or routes"),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "headers": {"A": "x\r\nB: y"}}]},
     "control character"),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "headers": {"A B": "x"}}]},
     "not an HTTP field name"),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "headers": {"A": "${TOKEN"}}]},
     "a $ must start"),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "headers": {}}]}, "headers: 1 to"),
    ({"allow_domains": ["api.test"], "inject": [{**RULE, "secret": "../etc/shadow"}]},
     "secret name"),
    ({"allow_domains": ["api.test"], "inject": [RULE, RULE]}, "twice"),
])
def test_bad_rules_are_config_errors(egress, says):
    with pytest.raises(ConfigError, match="invalid sandbox config") as info:
        make_config(network="public", egress=egress)
    assert says in str(info.value)


@pytest.mark.parametrize(("pattern", "allowed", "covered"), [
    ("a.test", ("a.test",), True),
    ("x.a.test", ("*.a.test",), True),
    ("*.a.test", ("*.a.test",), True),
    ("*.x.a.test", ("*.a.test",), True),
    ("a.test", ("*.a.test",), False),
    ("*.a.test", ("a.test",), False),
    ("xa.test", ("*.a.test",), False),
])
def test_covers(pattern, allowed, covered):
    assert covers(pattern, allowed) is covered


def test_a_sandbox_that_injects_is_never_served_from_stock():
    plain = make_config(network="public", egress={"allow_domains": ["api.test"]})
    injecting = make_config(network="public", egress={"allow_domains": ["api.test"],
                                                      "inject": [RULE]})
    assert boot_key(plain) is not None and boot_key(injecting) is None


# --- the store and its templates -------------------------------------------------------------


@pytest.mark.parametrize(("template", "keys", "rendered"), [
    ("Bearer $TOKEN", ["TOKEN"], "Bearer s3"),
    ("${A}-${TOKEN}x", ["A", "TOKEN"], "a-s3x"),
    ("$$TOKEN costs $$5", [], "$TOKEN costs $5"),
    ("plain", [], "plain"),
])
def test_templates(template, keys, rendered):
    assert secrets.placeholders(template) == keys
    assert secrets.render(template, {"TOKEN": "s3", "A": "a"}) == rendered


@pytest.mark.parametrize("bad", ["$", "a$", "$1", "${}", "${A", "$-", "x $ y"])
def test_a_dollar_that_starts_nothing_is_refused(bad):
    with pytest.raises(ValueError, match="a \\$ must start"):
        secrets.placeholders(bad)


def test_a_missing_key_is_a_key_error():
    with pytest.raises(KeyError):
        secrets.render("Bearer $TOKEN", {})


def test_the_store_is_root_only_atomic_and_scoped(tmp_path):
    store = secrets.SecretStore.of_home(tmp_path)
    store.put("api", {"TOKEN": "t1"})
    store.put("tenant-x/api", {"TOKEN": "t2"})
    assert (store.get("api"), store.get("tenant-x/api")) == ({"TOKEN": "t1"}, {"TOKEN": "t2"})
    assert store.names() == ["api", "tenant-x/api"] and store.names("tenant-x") == \
        ["tenant-x/api"]
    assert oct(os.stat(store.root).st_mode & 0o777) == "0o700"
    assert oct(os.stat(store.root / "api").st_mode & 0o777) == "0o600"
    store.put("api", {"TOKEN": "t3", "OTHER": "o"})
    assert store.get("api") == {"TOKEN": "t3", "OTHER": "o"}
    assert store.delete("tenant-x/api") and not store.delete("tenant-x/api")
    assert not (store.root / "tenant-x").exists()  # an empty scope goes with its last secret
    assert store.get("nope") is None


@pytest.mark.parametrize(("name", "values"), [
    ("../x", {"K": "v"}), ("a/b/c", {"K": "v"}), (".hidden", {"K": "v"}),
    ("ok", {}), ("ok", {"1K": "v"}), ("ok", {"K": "v\n"}), ("ok", {"K": 3}),
    ("ok", {"K": "x" * 9000}),
])
def test_bad_secrets_are_config_errors(tmp_path, name, values):
    with pytest.raises(ConfigError):
        secrets.SecretStore(tmp_path).put(name, values)


def test_the_proxy_reads_no_secret_through_a_link_or_of_any_size(tmp_path):
    (tmp_path / "target").write_text(json.dumps({"TOKEN": "x"}))
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert secrets.read(tmp_path, "target") == {"TOKEN": "x"}
    assert secrets.read(tmp_path, "link") is None
    (tmp_path / "big").write_text(json.dumps({"TOKEN": "x" * (secrets.MAX_FILE + 1)}))
    assert secrets.read(tmp_path, "big") is None
    os.mkfifo(tmp_path / "fifo")
    assert secrets.read(tmp_path, "fifo") is None  # neither blocks nor reads


# --- the trust bundle --------------------------------------------------------------------------


def test_the_bundle_env_is_for_sandboxes_that_inject_only():
    cfg = make_config(network="public", egress={"allow_domains": ["api.test"],
                                                "inject": [RULE]}).model_dump(mode="json")
    assert bundle.ca_env(cfg)["SSL_CERT_FILE"] == bundle.CA_BUNDLE
    assert bundle.ca_env(make_config(network="public").model_dump(mode="json")) == {}


def test_the_images_bundle_is_read_without_following_links(tmp_path):
    certs = tmp_path / "etc" / "ssl" / "certs"
    certs.mkdir(parents=True)
    secret = tmp_path / "host-secret"
    secret.write_text("not for the sandbox")
    (certs / "ca-certificates.crt").symlink_to(secret)
    assert bundle.image_ca_bundle(tmp_path) == b""
    (certs / "ca-certificates.crt").unlink()
    (certs / "ca-certificates.crt").write_text("-----BEGIN CERTIFICATE-----")
    assert bundle.image_ca_bundle(tmp_path) == b"-----BEGIN CERTIFICATE-----\n"
    (tmp_path / "etc" / "ssl" / "certs").rename(tmp_path / "elsewhere")
    (tmp_path / "etc" / "ssl" / "certs").symlink_to(tmp_path / "elsewhere")
    assert bundle.image_ca_bundle(tmp_path) == b""  # a linked directory on the way, too


# --- what the proxy parses ---------------------------------------------------------------------


def _client_hello(server_name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    if server_name is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_the_server_name_comes_from_the_client_hello():
    hello = _client_hello("API.test")
    assert client_hello_sni(hello) == (True, "api.test")
    assert client_hello_sni(hello[:40]) == (False, None)  # not all there yet
    assert client_hello_sni(_client_hello(None)) == (True, None)
    for junk in (b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\xff\xff" + b"\0" * 10):
        with pytest.raises(ValueError):
            client_hello_sni(junk)


@given(st.binary(max_size=600))
def test_no_client_hello_breaks_the_parser(data):
    try:
        client_hello_sni(b"\x16\x03\x01" + len(data).to_bytes(2, "big") + data)
    except ValueError:
        pass


def _head(text: str):
    return http1.parse_head(text.replace("\n", "\r\n").encode() + b"\r\n\r\n"
                             if not text.endswith("\n\n") else text.encode())


def test_heads_are_parsed_strictly():
    start, headers = _head("GET / HTTP/1.1\nHost: api.test\nX-A:  b ")
    assert start == b"GET / HTTP/1.1" and headers[1][:2] == ("x-a", b"b")
    for bad in ("GET / HTTP/1.1\nHost: a\n folded", "GET / HTTP/1.1\nNo colon",
                "GET / HTTP/1.1\nBad Name: x", "GET / HTTP/1.1\nX: a\x00b"):
        with pytest.raises(ProxyRefusal):
            _head(bad)


@pytest.mark.parametrize(("lines", "request_", "expected"), [
    ([], True, ("none", 0)),
    ([], False, ("close", 0)),
    (["Content-Length: 5"], True, ("length", 5)),
    (["Content-Length: 5", "Content-Length: 5"], True, ("length", 5)),
    (["Transfer-Encoding: gzip, chunked"], True, ("chunked", 0)),
    (["Transfer-Encoding: chunked, gzip"], False, ("close", 0)),
])
def test_framing(lines, request_, expected):
    _, headers = _head("\n".join(["X / HTTP/1.1", *lines]))
    assert framing(headers, request=request_) == expected


@pytest.mark.parametrize("lines", [
    ["Content-Length: 5", "Transfer-Encoding: chunked"],  # the smuggler's pair
    ["Content-Length: 5", "Content-Length: 6"], ["Content-Length: -1"],
    ["Content-Length: 0x10"], ["Transfer-Encoding: chunked, chunked"],
    ["Transfer-Encoding: gzip"],
])
def test_ambiguous_request_framing_is_refused(lines):
    _, headers = _head("\n".join(["POST / HTTP/1.1", *lines]))
    with pytest.raises(ProxyRefusal):
        framing(headers, request=True)


def test_the_rules_headers_replace_the_sandboxs_own():
    start, headers = _head("GET / HTTP/1.1\nHost: api.test\nauthorization: mine\nX-Keep: 1")
    out = http1.rewrite(start, headers, {"Authorization": "Bearer real"})
    assert out == (b"GET / HTTP/1.1\r\nHost: api.test\r\nX-Keep: 1\r\n"
                   b"Authorization: Bearer real\r\n\r\n")


@pytest.mark.parametrize("cut", [1, 3, 7, 9, 15])
def test_secrets_are_masked_across_reads(cut):
    secret = b"sk-0123456789"
    stream = b'{"echo": "Bearer ' + secret + b'", "again": "' + secret + b'"}'
    masker = Masker([secret])
    out = b""
    for i in range(0, len(stream), cut):
        out += masker.feed(stream[i : i + cut])
    out += masker.flush()
    assert len(out) == len(stream) and secret not in out
    assert out.count(b"*" * len(secret)) == 2


def test_masking_holds_back_only_what_may_start_a_secret():
    masker = Masker([b"secret-value"])
    assert masker.feed(b"data: 1\n\n") == b"data: 1\n\n"  # a stream's events pass at once
    assert masker.feed(b"x sec") == b"x "
    assert masker.feed(b"ond") == b"second"
    assert Masker([b"ab"]).feed(b"ab") == b"ab"  # too short to mask meaningfully


def test_the_most_specific_rule_applies():
    pol = Policy.parse({"allow_domains": ["*.a.test"], "inject": [
        {"domain": "*.a.test", "headers": {"X": "1"}},
        {"domain": "*.b.a.test", "headers": {"X": "2"}},
        {"domain": "c.b.a.test", "headers": {"X": "3"}}]})
    assert pol.rule_for("x.a.test").headers == (("X", "1"),)
    assert pol.rule_for("x.b.a.test").headers == (("X", "2"),)
    assert pol.rule_for("c.b.a.test").headers == (("X", "3"),)
    assert pol.rule_for("a.test") is None


def test_the_proxy_connects_only_where_the_sandboxs_table_would():
    eg = EgressPolicy(allow_cidrs=["10.1.0.0/16"], deny_cidrs=["198.18.9.0/24"])
    sets = policy.sets_for(eg, ["192.0.2.7"], ["10.213.0.0/16"])
    raw = {"sets": {"cidrs": dict(sets.cidrs), "private_domains": False}}
    pol = Policy.parse(raw)
    assert pol.address_ok("198.18.1.1")
    assert pol.address_ok("10.1.2.3")  # allow_cidrs open a private range
    for never in ("127.0.0.1", "169.254.169.254", "192.0.2.7", "198.18.9.1", "10.213.0.2",
                  "10.2.0.1", "::1", "fe80::1"):
        assert not pol.address_ok(never), never
    raw["sets"]["private_domains"] = True
    assert Policy.parse(raw).address_ok("10.2.0.1")


def test_requests_the_proxy_refuses():
    pol = Policy.parse({"allow_domains": ["api.test"]})
    _, ok = _head("GET / HTTP/1.1\nHost: API.test:443")
    inject._check_request("api.test", b"GET", b"/", ok, pol)
    cases = [
        (b"CONNECT", b"other.test:443", "Host: other.test", 405),
        (b"TRACE", b"/", "Host: api.test", 405),
        (b"GET", b"https://other.test/", "Host: api.test", 400),
        (b"GET", b"/", "Host: other.test", 421),
        (b"GET", b"/", "Host: api.test\nHost: api.test", 400),
        (b"GET", b"/", "Host: api.test\nUpgrade: websocket", 501),
    ]
    for method, target, lines, status in cases:
        _, headers = _head(f"{method.decode()} {target.decode()} HTTP/1.1\n{lines}")
        with pytest.raises(ProxyRefusal) as info:
            inject._check_request("api.test", method, target, headers, pol)
        assert info.value.status == status, (method, target, lines)


def test_the_audit_and_metrics_hold_no_value(tmp_path: Path):
    books = inject.Books("s" * 32, tmp_path / "audit.jsonl", tmp_path / "m.prom")
    books.audit("api.test", "POST", 200, ["Authorization"])
    books.count("ray_sandbox_inject_requests_total", domain="api.test", status="200")
    books.flush(force=True)
    line = json.loads((tmp_path / "audit.jsonl").read_text())
    assert set(line) == {"time", "sandbox", "domain", "method", "status", "headers"}
    text = (tmp_path / "m.prom").read_text()
    assert f'ray_sandbox_inject_requests_total{{sandbox="{"s" * 32}",domain="api.test",' \
           'status="200"} 1' in text
    assert "# TYPE ray_sandbox_inject_active_connections gauge" in text
