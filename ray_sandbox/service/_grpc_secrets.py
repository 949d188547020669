"""Modal's secrets on the control plane: inline ones (``Secret.from_dict``, the
``secrets=`` of a create or an exec) are kept per tenant by their content; named secrets
(``Secret.from_name``) are not kept by this service and are refused naming them. A
sandbox's or a command's environment is its secrets' contents (:meth:`Secrets.env`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from modal_proto import api_pb2

from ._grpc import Call, bounded_put, hash_id, not_found, unimplemented

C = api_pb2.ObjectCreationType


class Secrets:
    """The secret handler and each tenant's inline secrets (``MAX_PER_TENANT``, least
    recently created forgotten)."""

    def __init__(self) -> None:
        self._secrets: dict[str, OrderedDict[str, dict[str, str]]] = {}

    async def SecretGetOrCreate(self, call: Call,
                                req: api_pb2.SecretGetOrCreateRequest) -> Any:
        inline = req.object_creation_type in (C.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP,
                                              C.OBJECT_CREATION_TYPE_EPHEMERAL)
        if not inline:
            if req.deployment_name and not req.env_dict:
                raise not_found(f"secret {req.deployment_name!r} not found: this service keeps "
                                "no named secrets; use Secret.from_dict")
            raise unimplemented("named secrets (Secret.from_name, modal secret create)")
        env = dict(req.env_dict)
        sid = hash_id("st", call.tenant, repr(sorted(env.items())))
        bounded_put(self._secrets.setdefault(call.tenant, OrderedDict()), sid, env)
        return api_pb2.SecretGetOrCreateResponse(secret_id=sid)

    def env(self, tenant: str, sources: Any, secret_ids: Any) -> dict[str, str]:
        """The environment of the tenant's secrets, by id (``secret_ids``) and as sources
        (an inline ``env`` or a secret's id); an unknown one is NOT_FOUND."""
        env: dict[str, str] = {}
        mine = self._secrets.get(tenant, OrderedDict())
        for sid in secret_ids:
            if sid not in mine:
                raise not_found(f"secret {sid!r} not found")
            env.update(mine[sid])
        for source in sources:
            if source.WhichOneof("source") == "env":
                env.update(dict(source.env.contents))
            elif source.secret_id in mine:
                env.update(mine[source.secret_id])
            else:
                raise not_found(f"secret {source.secret_id!r} not found: this service keeps "
                                "no named secrets; use Secret.from_dict")
        return env
