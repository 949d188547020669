"""The service's pure pieces: token and quota parsing, quota arithmetic, the constant-time
token check, the error mapping and path checks (the HTTP behaviour is in
tests/test_service*.py, against a real Serve app)."""

from __future__ import annotations

import time

import pytest

from ray_sandbox.runtime import errors
from ray_sandbox.runtime.config import SandboxConfig
from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.service import Quota, ServiceConfig, from_env, parse_quota, parse_tokens
from ray_sandbox.service._app import authenticate
from ray_sandbox.service._config import ANY_TENANT, tokens_from
from ray_sandbox.service._errors import code_of, status_of
from ray_sandbox.service._models import check_path
from ray_sandbox.service._ports import ray_port_url
from ray_sandbox.service._quota import Charge, charge, over_quota
from ray_sandbox.service._signing import sign, verify

GiB = 2**30


def test_tokens_parse_from_the_env_pairs_and_a_file(tmp_path):
    assert parse_tokens(" a=tok-aaaa , b = tok-bbbb ,") == {"a": "tok-aaaa", "b": "tok-bbbb"}
    f = tmp_path / "tokens"
    f.write_text("# tenants\nc=tok-cccc\n\n d=tok=with=equals \n")
    env = {"RAY_SANDBOX_API_TOKEN": "tok-default", "RAY_SANDBOX_API_TOKENS": "a=tok-aaaa"}
    assert tokens_from(env, f) == {"default": "tok-default", "a": "tok-aaaa", "c": "tok-cccc",
                                   "d": "tok=with=equals"}
    env_file = {"RAY_SANDBOX_API_TOKENS_FILE": str(f)}
    assert tokens_from(env_file) == {"c": "tok-cccc", "d": "tok=with=equals"}


@pytest.mark.parametrize("text", ["secret", "a=", "=secret", "a=secret,a=secret2"])
def test_bad_token_lists_are_refused_without_echoing_the_token(text):
    with pytest.raises(errors.ConfigError) as info:
        parse_tokens(text)
    assert "secret" not in str(info.value)


def test_the_config_refuses_no_tokens_short_ones_and_shared_ones(tmp_path):
    with pytest.raises(errors.ConfigError, match="no API token"):
        from_env({})
    with pytest.raises(errors.ConfigError, match="at least 8"):
        from_env({"RAY_SANDBOX_API_TOKEN": "short"})
    with pytest.raises(errors.ConfigError, match="share a token"):
        from_env({"RAY_SANDBOX_API_TOKENS": "a=same-token,b=same-token"})
    with pytest.raises(errors.ConfigError, match="given twice"):
        from_env({"RAY_SANDBOX_API_TOKEN": "tok-12345678",
                  "RAY_SANDBOX_API_TOKENS": "default=tok-87654321"})
    with pytest.raises(errors.ConfigError, match="cannot read"):
        from_env({}, tokens_file=tmp_path / "missing")


def test_quotas_parse_per_tenant_and_for_everyone():
    assert parse_quota("bob:sandboxes=2,cpu=1.5,memory=3Gi") == (
        "bob", Quota(sandboxes=2, cpu=1.5, memory=3 * GiB))
    tenant, q = parse_quota("sandboxes=5")
    assert tenant == ANY_TENANT and q.sandboxes == 5 and q.cpu == Quota().cpu
    for bad in ["disks=1", "sandboxes", "cpu=-1", "memory=lots"]:
        with pytest.raises(errors.ConfigError):
            parse_quota(bad)
    cfg = from_env({"RAY_SANDBOX_API_TOKEN": "tok-12345678"}, quotas=("bob:sandboxes=1",
                                                                       "sandboxes=7"))
    assert cfg.quota("bob").sandboxes == 1 and cfg.quota("anyone").sandboxes == 7
    assert ServiceConfig(tokens={"a": "tok-12345678"}).quota("a") == Quota()


def test_quota_arithmetic_names_the_limit_reached():
    q = Quota(sandboxes=3, cpu=1.0, memory=GiB)
    quarter = Charge(0.25, 128 * 2**20)
    assert over_quota(q, [], quarter) is None
    assert over_quota(q, [quarter, quarter], quarter) is None
    assert "3 sandboxes" in over_quota(q, [quarter] * 3, quarter)
    assert "CPUs" in over_quota(q, [Charge(0.9, 1)], quarter)
    assert over_quota(q, [Charge(0.1, 1)] * 2, Charge(0.8, 1)) is None  # 1.0, not 1.0000001
    assert "memory" in over_quota(q, [Charge(0.1, GiB)], Charge(0.1, 1))
    assert charge(SandboxConfig(cpu=0.5, memory="256Mi")) == Charge(0.5, 256 * 2**20)
    for unbounded in [SandboxConfig(cpu=0), SandboxConfig(memory=None)]:
        with pytest.raises(errors.ConfigError):
            charge(unbounded)


def test_authenticate_matches_one_tenant_in_constant_time():
    tokens = {"a": b"tok-aaaaaaaa", "b": b"tok-bbbbbbbb"}
    assert authenticate(tokens, "Bearer tok-bbbbbbbb") == "b"
    assert authenticate(tokens, "bearer  tok-aaaaaaaa ") == "a"
    for header in ["", "Bearer", "Bearer tok-aaaaaaa", "Basic tok-aaaaaaaa",
                   "Bearer tok-aaaaaaaaa", "tok-aaaaaaaa"]:
        assert authenticate(tokens, header) is None


def test_errors_map_to_a_status_and_the_code_of_their_class():
    cases = [(errors.SandboxNotFoundError("x"), 404, "sandbox_not_found"),
             (errors.SandboxFileNotFoundError("x"), 404, "sandbox_file_not_found"),
             (errors.ConfigError("x"), 400, "config"),
             (errors.FileTooLargeError("x"), 413, "file_too_large"),
             (errors.SandboxIsADirectoryError("x"), 409, "sandbox_is_a_directory"),
             (errors.AgentTimeoutError("x"), 504, "agent_timeout"),
             (errors.CapacityError("x"), 503, "capacity"),
             (errors.RegistryUnreachableError("x"), 502, "registry_unreachable"),
             (errors.CommandError("x"), 500, "command")]
    for exc, status, code in cases:
        assert (status_of(exc), code_of(exc)) == (status, code)


def test_paths_must_be_absolute_and_are_normalized():
    assert check_path("/tmp/../etc//x/.") == "/etc/x"
    assert check_path("/../../x") == "/x"
    for bad in ["", "tmp/x", "/tmp/\0", "/" + "a" * 5000]:
        with pytest.raises(ValueError):
            check_path(bad)


def test_port_tokens_verify_only_genuine_unexpired_ones():
    key = b"k" * 32
    token = sign(key, {"sid": "a" * 32, "port": 8080, "tenant": "t", "exp": 1000.0})
    assert verify(key, token, 999.0) == ({"sid": "a" * 32, "port": 8080, "tenant": "t",
                                          "exp": 1000.0}, "")
    assert verify(key, token, 1000.0) == (None, "expired token")
    assert verify(b"other-key" * 4, token, 0) == (None, "bad signature")
    claims, mac = token.split(".")
    forged = sign(key, {"sid": "b" * 32, "port": 8080, "tenant": "t", "exp": 1000.0})
    assert verify(key, f"{forged.split('.')[0]}.{mac}", 0) == (None, "bad signature")
    for bad in ["", "nodot", f"{claims}.!!!", f"{claims}.", "." * 3000]:
        assert verify(key, bad, 0)[0] is None
    no_expiry = sign(key, {"sid": "a"})
    assert verify(key, no_expiry, 0) == (None, "expired token")


def test_port_urls_of_ray_sandboxes_name_no_tenant_and_only_published_ports():
    config = from_env({"RAY_SANDBOX_API_TOKEN": "token-0123456789",
                       "RAY_SANDBOX_API_PUBLIC_URL": "https://svc.example/"},
                      signing_key="k" * 32, max_port_url_seconds=60)
    assert config.public_url == "https://svc.example"
    signed = ray_port_url(config, config.public_url + "/api/v1", "a" * 32, "node-1",
                          (8080,), 8080, ttl=3600)  # capped at 60 s
    token = signed["token"]
    assert signed["url"] == f"https://svc.example/api/v1/ports/{'a' * 32}/8080/{token}"
    claims, _ = verify(b"k" * 32, token, signed["expires_at"] - 1)
    assert set(claims) == {"sid", "port", "node", "exp"}  # no tenant: no tenant route opens
    assert signed["expires_at"] - time.time() <= 60
    with pytest.raises(ConfigError, match="not published"):
        ray_port_url(config, "", "a" * 32, "node-1", (8080,), 9, ttl=None)
    with pytest.raises(ConfigError, match="public_url"):
        from_env({"RAY_SANDBOX_API_TOKEN": "token-0123456789"}, public_url="svc.example")


def test_error_messages_name_a_tenants_filesystem_image_not_its_host_path():
    from ray_sandbox.service._kept import FS_IMAGE_PATH_RE

    image_id = "0123456789abcdef" * 2
    text = (f"image_not_found: 'oci:/var/lib/rsb/fs-images/node1/{image_id}:image' is not "
            f"in the image store; fetched to /home/x/fs-images/node1/{image_id}")
    assert FS_IMAGE_PATH_RE.sub("fs-image://i", text) == (
        "image_not_found: 'fs-image://i' is not in the image store; fetched to fs-image://i")
