"""Pure parts of the network package: nft script generation, domain matching, DNS messages."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_sandbox.runtime.config import EgressPolicy, make_config
from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.runtime.network import dns, ip, nft, policy
from ray_sandbox.runtime.network.settings import host_link, tag, tag_of

POOL = "10.213.0.0/16"


def _sets(**kw) -> policy.Sets:
    return policy.sets_for(EgressPolicy(**kw), ["192.0.2.2", "fd00::2"], [POOL])


def test_split_collapses_and_separates_families() -> None:
    v4, v6 = policy.split(["10.0.0.0/8", "10.1.0.0/16", "10.0.0.1", "fe80::/10", "fe80::1"])
    assert v4 == ("10.0.0.0/8",)
    assert v6 == ("fe80::/10",)


@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(8, 32)), max_size=20))
def test_split_never_overlaps(nets: list[tuple[int, int]]) -> None:
    cidrs = [str(ipaddress.ip_network((a, p), strict=False)) for a, p in nets]
    v4, _ = policy.split(cidrs)
    parsed = [ipaddress.ip_network(c) for c in v4]
    assert all(not a.overlaps(b) for i, a in enumerate(parsed) for b in parsed[i + 1 :])
    for c in cidrs:  # nothing was lost
        assert any(ipaddress.ip_network(c).subnet_of(p) for p in parsed)


def test_sets_place_every_range_in_its_tier() -> None:
    s = _sets(allow_cidrs=("10.99.0.1/32",), deny_cidrs=("198.18.1.2/32",))
    assert s.cidrs["deny4"] == ("10.213.0.0/16", "198.18.1.2/32")  # user denies + other sandboxes
    assert s.cidrs["allow4"] == ("10.99.0.1/32",)
    assert "169.254.0.0/16" in s.cidrs["never4"] and "192.0.2.2/32" in s.cidrs["never4"]
    assert "fd00::2/128" in s.cidrs["never6"]
    assert "10.0.0.0/8" in s.cidrs["private4"] and "fc00::/7" in s.cidrs["private6"]
    assert s.default == "allow"


def test_egress_chain_order_and_default() -> None:
    rules = policy._egress_rules(_sets(default="deny"))
    order = [r.split("@")[1].split()[0] for r in rules if "@" in r]
    assert order == ["deny4", "deny6", "allow4", "allow6", "never4", "never6", "dyn4", "dyn6",
                     "private4", "private6"]
    assert rules[-1] == "goto refuse"
    assert policy._egress_rules(_sets())[-1] == "accept"


def test_without_private_domains_names_open_no_private_address() -> None:
    rules = policy._egress_rules(_sets(private_domains=False))
    order = [r.split("@")[1].split()[0] for r in rules if "@" in r]
    assert order.index("private4") < order.index("dyn4")
    assert order.index("never4") < order.index("private4")


def test_public_table_filters_output_and_passes_loopback_and_replies() -> None:
    text = policy.public_table("rsb-0123456789ab", _sets())
    assert "table inet rsb-0123456789ab {" in text
    assert "type filter hook output priority 0; policy accept;" in text
    out = text.split("chain output {")[1]
    assert out.index('oifname "lo" accept') < out.index("ct direction reply accept")
    assert out.index("ct direction reply accept") < out.index("jump egress")
    assert "add element inet rsb-0123456789ab never4 {" in text


def test_nat_table_masquerades_publishes_and_redirects_dns() -> None:
    p = policy.NatParams(link="rsb0123456789ab", gateway="10.213.0.1", address="10.213.0.2",
                         subnet="10.213.0.0/30", dns_port=40000, expose_addr="127.0.0.1",
                         ports=(8080,))
    text = policy.nat_table("rsb-0123456789ab", _sets(), p)
    assert 'ip saddr 10.213.0.0/30 oifname != "rsb0123456789ab" masquerade' in text
    assert "th dport 53 dnat ip to 10.213.0.1:40000" in text
    assert text.count("ip daddr 127.0.0.1 tcp dport 8080 dnat ip to 10.213.0.2:8080") == 2
    assert 'iifname "rsb0123456789ab" ct direction original jump egress' in text
    forward = text.split("chain forward {")[1]
    # links come first: the pool of other sandboxes is in the deny set
    assert forward.index("@peers accept") < forward.index("jump egress")
    wide = policy.nat_table("rsb-0123456789ab", _sets(), p.__class__(**{
        **p.__dict__, "expose_addr": "0.0.0.0"}))
    assert "fib daddr type local tcp dport 8080" in wide
    assert "dport 443" not in text  # no egress proxy unless the sandbox injects
    proxied = policy.nat_table("rsb-0123456789ab", _sets(), p.__class__(**{
        **p.__dict__, "proxy_port": 41000}))
    assert ('iifname "rsb0123456789ab" ip daddr 10.213.0.1 tcp dport 443 dnat ip to '
            "10.213.0.1:41000") in proxied
    inbound = proxied.split("chain input {")[1]
    assert inbound.index("tcp dport 41000 accept") < inbound.index("jump egress")


def test_update_script_is_one_transaction_over_existing_objects() -> None:
    text = policy.update_script("rsb-0123456789ab", _sets(default="deny"),
                                {"198.18.1.1": 30, "2001:db8::1": 5})
    lines = text.splitlines()
    assert lines[0] == "flush chain inet rsb-0123456789ab egress"
    assert "flush set inet rsb-0123456789ab dyn4" in lines
    assert "add rule inet rsb-0123456789ab egress goto refuse" in lines
    assert "add element inet rsb-0123456789ab dyn4 { 198.18.1.1 timeout 30s }" in lines
    assert "add element inet rsb-0123456789ab dyn6 { 2001:db8::1 timeout 5s }" in lines


@pytest.mark.parametrize(("link", "port"), [("rsb0123456789ab", 0), ("rsb0123456789ab", 65536),
                                            ('rsb" } ; flush ruleset', 80)])
def test_link_script_refuses_what_nft_would_misread(link: str, port: int) -> None:
    with pytest.raises(ValueError):
        policy.link_script("rsb-0123456789ab", link, port, add=True)


@pytest.fixture
def scratch_netns():
    name = "rsbt-nftcheck"
    ip.netns_delete(name)
    ip.netns_add(name)
    yield name
    ip.netns_delete(name)


def test_generated_scripts_are_accepted_by_nft(scratch_netns: str) -> None:
    table = "rsb-0123456789ab"
    sets = _sets(allow_cidrs=("10.99.0.0/24", "2001:db8::/32"), deny_cidrs=("198.18.1.2",))
    p = policy.NatParams(link="rsb0123456789ab", gateway="10.213.0.1", address="10.213.0.2",
                         subnet="10.213.0.0/30", dns_port=40000, expose_addr="0.0.0.0",
                         ports=(8080, 9090), proxy_port=41000)
    nft.apply(scratch_netns, policy.nat_table(table, sets, p))
    nft.apply(scratch_netns, policy.update_script(table, _sets(default="deny"),
                                                  {"198.18.1.1": 30}))
    nft.apply(scratch_netns, "\n".join(policy.dyn_elements(table, {"198.18.1.9": 60})) + "\n")
    nft.apply(scratch_netns, policy.link_script(table, "rsbfedcba987654", 8080, add=True))
    nft.apply(scratch_netns, policy.link_script(table, "rsbfedcba987654", 8080, add=False))
    nft.delete_table(scratch_netns, "inet", table)
    nft.apply(scratch_netns, policy.public_table(table, sets))
    assert ("inet", table) in nft.tables(scratch_netns)


@pytest.mark.parametrize(
    ("name", "patterns", "allowed"),
    [
        ("example.com", ("example.com",), True),
        ("EXAMPLE.com.", ("example.com",), True),
        ("www.example.com", ("example.com",), False),
        ("www.example.com", ("*.example.com",), True),
        ("a.b.example.com", ("*.example.com",), True),
        ("example.com", ("*.example.com",), False),
        ("badexample.com", ("*.example.com",), False),
        ("example.org", ("example.com", "*.example.com"), False),
    ],
)
def test_domain_allowed(name: str, patterns: tuple[str, ...], allowed: bool) -> None:
    assert policy.domain_allowed(name, patterns) is allowed


def test_dns_timeout_is_bounded() -> None:
    assert policy.dns_timeout(0) == policy.DNS_TTL_MIN
    assert policy.dns_timeout(300) == 300
    assert policy.dns_timeout(10**6) == policy.DNS_TTL_MAX


def _query(name: str, qtype: int = dns.A, qid: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(
        "!HH", qtype, 1)


_label = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)


@given(st.lists(_label, min_size=1, max_size=5), st.sampled_from([dns.A, dns.AAAA]))
def test_dns_reply_round_trip(labels: list[str], qtype: int) -> None:
    name = ".".join(labels)
    q = _query(name, qtype)
    assert dns.question(q)[:2] == (name, qtype)
    answers = ["198.18.1.1", "2001:db8::1"]
    r = dns.reply(q, dns.NOERROR, answers, ttl=42)
    assert r[:2] == q[:2] and r[3] & 0x0F == dns.NOERROR
    want = "198.18.1.1" if qtype == dns.A else "2001:db8::1"
    assert dns.addresses(r) == [(want, 42)]


def test_dns_refused_and_garbage() -> None:
    r = dns.reply(_query("x.test"), dns.REFUSED)
    assert r[3] & 0x0F == dns.REFUSED and dns.addresses(r) == []
    with pytest.raises(ValueError):
        dns.question(b"\x00" * 5)
    looping = struct.pack("!HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c"
    with pytest.raises(ValueError):
        dns.question(looping)


def test_names_fit_the_kernel_and_are_recognised() -> None:
    t = tag("0123456789abcdef0123456789abcdef")
    assert t == "rsb-0123456789ab"
    assert len(host_link(t)) == 15
    assert tag_of(t) == t and tag_of(host_link(t)) == t
    assert tag_of("rsbt-node") is None and tag_of("eth0") is None
    with pytest.raises(ConfigError):
        tag("../etc")


@pytest.mark.parametrize(
    "egress",
    [{"allow_cidrs": ["10.0.0.0/33"]}, {"deny_cidrs": ["nope"]}, {"allow_domains": ["a b.com"]},
     {"allow_domains": ["-bad-.com"]}, {"default": "maybe"}],
)
def test_invalid_policy_is_a_config_error(egress: dict) -> None:
    with pytest.raises(ConfigError):
        make_config(network="public", egress=egress)
