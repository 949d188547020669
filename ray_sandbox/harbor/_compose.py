"""Compose tasks inside one Docker sandbox: the task's compose file rewritten for Docker
under gVisor, and the ``docker`` command lines that reach its ``main`` service.

Under gVisor Docker has no iptables (docs/docker.md): containers on a bridge network cannot
resolve each other's names (the embedded DNS at 127.0.0.11 is wired with NAT rules) and
published ports do not work. So every service joins the sandbox's own network
(``network_mode: host``) and reaches the others by name through ``extra_hosts`` entries that
point each service name at 127.0.0.1; services must then listen on distinct ports, as on
one host. ``docker exec`` (how Harbor's calls reach ``main``) cannot enter a container's own
PID namespace under runsc 0.0~20240729 (``error executing setns process``), so every
service shares the sandbox's (``pid: host``). Everything else of the file is kept.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any

from ..runtime.docker import base_images

MAIN = "main"  # Harbor's name for the service its agent and verifier run in
PROJECT = "rsb"
ENV_DIR = "/rsb/env"
COMPOSE_FILE = f"{ENV_DIR}/docker-compose.rsb.json"
_DROP = ("networks", "ports", "links", "network_mode", "expose", "pid")


def rewrite(compose: Mapping[str, Any]) -> dict[str, Any]:
    """The task's compose file with every service on the sandbox's network and the other
    services' names resolving to 127.0.0.1."""
    services = compose.get("services")
    if not isinstance(services, Mapping) or MAIN not in services:
        raise ValueError(f"a compose task needs a '{MAIN}' service")
    names = sorted(services)
    out_services: dict[str, Any] = {}
    for name, svc in services.items():
        svc = {k: v for k, v in dict(svc or {}).items() if k not in _DROP}
        svc["network_mode"] = "host"
        svc["pid"] = "host"
        hosts = svc.get("extra_hosts") or []
        if isinstance(hosts, Mapping):
            hosts = [f"{k}:{v}" for k, v in hosts.items()]
        svc["extra_hosts"] = list(hosts) + [f"{n}:127.0.0.1" for n in names]
        build = svc.get("build")
        if isinstance(build, str):
            build = {"context": build}
        if isinstance(build, Mapping):
            svc["build"] = {**build, "network": "host"}
        out_services[name] = svc
    out = {k: v for k, v in compose.items() if k not in ("services", "networks")}
    out["version"] = "3.8"  # build.network needs 3.4+; compose 1.29 reads up to 3.9
    out["services"] = out_services
    return out


def build_bases(compose: Mapping[str, Any],
                read_dockerfile: Callable[[str, str], str]) -> list[str]:
    """Images the compose file needs from outside: ``image:`` of services that are not built,
    and the ``FROM`` images of the built ones (``read_dockerfile(context, file)`` returns a
    Dockerfile's text)."""
    bases: list[str] = []
    for svc in (compose.get("services") or {}).values():
        svc = svc or {}
        build = svc.get("build")
        if build is None:
            if svc.get("image"):
                bases.append(svc["image"])
            continue
        if isinstance(build, str):
            build = {"context": build}
        text = read_dockerfile(build.get("context", "."), build.get("dockerfile", "Dockerfile"))
        bases += base_images(text)
    return list(dict.fromkeys(bases))


# Killing the `docker exec` client does not stop the command inside the container, so a
# timeout is enforced in the container itself (timeout(1): exit 124, as Harbor expects);
# the outer exec gets this much longer as a backstop.
TIMEOUT_GRACE_S = 15


def exec_command(container: str, command: str, *, shell: str, cwd: str | None,
                 env: Mapping[str, str] | None, user: str | None,
                 timeout: float | None = None) -> str:
    """The outer sandbox's command that runs ``command`` in the main service's container,
    under ``timeout(1)`` when ``timeout`` is given (the container must have it)."""
    argv = ["docker", "exec", "-i"]
    if cwd:
        argv += ["-w", cwd]
    for k, v in (env or {}).items():
        argv += ["-e", f"{k}={v}"]
    if user is not None:
        argv += ["-u", user]
    inner = [shell, "-c", command]
    if timeout is not None:
        inner = ["timeout", "-k", "5", f"{timeout:g}", *inner]
    return shlex.join([*argv, container, *inner])
