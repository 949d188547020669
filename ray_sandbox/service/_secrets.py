"""Each tenant's secrets for credential injection (docs/network.md, "Credential injection").

The nodes keep them (``ray_sandbox.actor.secrets``: every live node's store), each tenant's in
a scope of its own: a tenant's secret ``api`` is the nodes' ``t-<16 hex of the tenant>/api``.
A tenant names only its own, in the API (``PUT``/``DELETE /secrets/{name}``, ``GET
/secrets`` lists names, never values) and in a create's ``egress.inject``, whose names the
service maps into the tenant's scope before its policy sees them (:meth:`TenantSecrets.
scoped`); the policy refuses any name left unmapped (``_policy._egress``), so no tenant can
name another's secret or the operator's. Values arrive in a request body and leave only
toward the nodes: the audit line of a put names the secret, never its values."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import anyio
from pydantic import Field

from ..actor import secrets as cluster
from ..runtime.config import SandboxConfig
from ..runtime.errors import ConfigError
from ..runtime.secrets import MAX_KEYS, check_name
from . import _errors
from ._models import Body
from ._policy import SECRET_SCOPE_PREFIX as SCOPE_PREFIX

MAX_SECRETS = 64  # per tenant


def scope(tenant: str) -> str:
    return SCOPE_PREFIX + hashlib.sha256(tenant.encode()).hexdigest()[:16]


class PutSecret(Body):
    """``PUT /secrets/{name}``: the secret's keys and values (``$KEY`` in a rule's headers)."""

    values: dict[str, str] = Field(description=f"1-{MAX_KEYS} keys (letters, digits, _) to "
                                   "values of at most 8 KiB without control characters")


class TenantSecrets:
    """The tenants' secrets; the blocking calls (one task per node) run in threads of their
    own, a few at a time."""

    def __init__(self) -> None:
        self._threads = anyio.CapacityLimiter(4)

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    @staticmethod
    def _checked(name: str) -> str:
        try:
            if "/" in name:
                raise ValueError("a scope is the service's")
            return check_name(name)
        except ValueError:
            raise _errors.refusal(400, f"secret name {name!r}: 1-64 of A-Za-z0-9_.-, starting "
                                       "with a letter or digit") from None

    async def put(self, tenant: str, name: str, values: dict[str, str]) -> None:
        self._checked(name)
        have = await self.list(tenant)
        if name not in have and len(have) >= MAX_SECRETS:
            raise _errors.refusal(429, f"this tenant has {MAX_SECRETS} secrets, its limit; "
                                       "delete one first")
        try:
            await self._blocking(cluster.put_secret, f"{scope(tenant)}/{name}", values)
        except ConfigError as exc:
            raise _errors.refusal(400, exc.message.replace(scope(tenant) + "/", "")) from None

    async def delete(self, tenant: str, name: str) -> None:
        """Idempotent; sandboxes using it get no value from their next request on."""
        await self._blocking(cluster.delete_secret, f"{scope(tenant)}/{self._checked(name)}")

    async def list(self, tenant: str) -> list[str]:
        mine = scope(tenant)
        names: Sequence[str] = await self._blocking(cluster.secret_names, mine)
        return [n.removeprefix(mine + "/") for n in names]

    async def scoped(self, tenant: str, body: SandboxConfig) -> SandboxConfig:
        """A create's config with its inject rules' secrets named in the tenant's scope; a
        name the tenant has no secret of is a 400."""
        egress = body.egress
        if egress is None or not any(r.secret for r in egress.inject):
            return body
        have = set(await self.list(tenant))
        rules = []
        for rule in egress.inject:
            if rule.secret is not None:
                if rule.secret not in have:
                    raise _errors.refusal(400, f"egress.inject: no secret {rule.secret!r} for "
                                               "this tenant (PUT /secrets/{name} stores one)")
                rule = rule.model_copy(update={"secret": f"{scope(tenant)}/{rule.secret}"})
            rules.append(rule)
        return body.model_copy(update={"egress": egress.model_copy(
            update={"inject": tuple(rules)})})


__all__ = ["PutSecret", "TenantSecrets", "scope"]
