"""Modal's ``App`` and ``Secret``, as far as sandboxes use them: an App is a name its
sandboxes are labelled with, a Secret environment variables. (``Image``: image.py.)"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..runtime.errors import ModalNotFoundError
from ._aio import static
from ._options import refuse
from ._refuse import refused, refused_attribute, refused_static

_PLATFORM = "Modal Functions and deployed apps are not part of ray_sandbox.modal, which has "\
    "Modal's sandboxes"


class App:
    """A name for a group of sandboxes (``Sandbox.list(app_id=app.app_id)``). There is no
    app registry: every name exists."""

    def __init__(self, name: str | None = None, **options: Any) -> None:
        refuse(options, "App")  # image=, secrets=, volumes=: functions, not sandboxes
        self.name = name
        self.app_id = name

    def __repr__(self) -> str:
        return f"App({self.name!r})"

    @static
    def lookup(name: str, *, create_if_missing: bool = False,  # noqa: ARG004 - always there
               environment_name: str | None = None, client: Any = None) -> App:
        refuse({"environment_name": environment_name, "client": client}, "App.lookup")
        return App(name)

    function = refused("App.function", _PLATFORM)
    cls = refused("App.cls", _PLATFORM)
    server = refused("App.server", _PLATFORM)
    local_entrypoint = refused("App.local_entrypoint", _PLATFORM)
    run = refused("App.run", _PLATFORM + "; use App.lookup(name) for sandboxes")
    deploy = refused("App.deploy", _PLATFORM)
    stop = refused("App.stop", _PLATFORM + "; terminate its sandboxes "
                   "(Sandbox.list(app_id=...))")
    get_dashboard_url = refused("App.get_dashboard_url", "no Modal dashboard here; Ray's "
                                "dashboard shows the cluster")


class Secret:
    """Environment variables for a sandbox or an exec."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    @static
    def from_dict(env_dict: Mapping[str, str | None]) -> Secret:
        return Secret({k: v for k, v in env_dict.items() if v is not None})

    @static
    def from_local_environ(env_keys: Sequence[str]) -> Secret:
        missing = [k for k in env_keys if k not in os.environ]
        if missing:
            raise ModalNotFoundError(f"not in the local environment: {', '.join(missing)}")
        return Secret({k: os.environ[k] for k in env_keys})

    @static
    def from_dotenv(path: str | os.PathLike[str] | None = None, *, filename: str = ".env",
                    client: Any = None) -> Secret:
        """The variables of a ``.env`` file (``KEY=value`` lines; ``#`` comments, ``export``
        and quotes as dotenv writes them): ``path`` is the file or its directory (default:
        the current directory)."""
        refuse({"client": client}, "Secret.from_dotenv")
        where = Path(path) if path is not None else Path.cwd()
        file = where / filename if where.is_dir() else where
        if not file.is_file():
            raise ModalNotFoundError(f"no dotenv file {file}")
        env: dict[str, str] = {}
        for raw in file.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, value = line.removeprefix("export ").split("=", 1)
            value = value.strip()
            if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            elif " #" in value:
                value = value.split(" #", 1)[0].rstrip()
            env[key.strip()] = value
        return Secret(env)

    from_name = refused_static("Secret.from_name", "there is no secret store here; use "
                               "Secret.from_dict, from_local_environ or from_dotenv")
    objects = refused_attribute("Secret.objects", "there is no secret store here; use "
                                "Secret.from_dict, from_local_environ or from_dotenv")
