"""RaySandboxEnvironment: a Harbor environment whose container is a ray_sandbox gVisor sandbox,
placed by Ray anywhere in the cluster."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Literal

import ray
import yaml
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkPolicy
from harbor.models.trial.config import ResourceMode
from pydantic import Field, field_validator
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..actor import SandboxHandle, SandboxTemplate, create_from_template
from ..runtime import ExecResult as SandboxExecResult
from ..runtime import OutputChunk, SandboxConfig, SandboxRuntime, docker, paths
from ..runtime.config import make_config
from ..runtime.doctor import diagnose
from ..runtime.image_builders import export_layout
from ..runtime.images import ImageStore
from . import _compose, _policy

TIMEOUT_EXIT_CODE = 124  # what timeout(1) returns; Harbor tasks know it
# A Compose task's sandbox holds dockerd and every service's image in memory (docs/docker.md)
_COMPOSE_MIN_MEMORY = 2**30


# The SandboxConfig fields _template derives from the task and the trial; the `sandbox` option
# refuses them, so that it never silently loses to (or overrides) the task.
_TASK_FIELDS = ("image", "cpu", "memory", "disk", "env", "workdir", "readonly",
                "timeout_seconds", "network", "egress", "labels")


class RaySandboxOptions(EnvironmentOptions):
    """``--ek`` options of the ray_sandbox environment."""

    ray_address: str | None = Field(
        None, description="Ray cluster to join ('auto', 'host:6379', 'ray://host:10001'); "
        "default: $RAY_ADDRESS, else a local cluster started by this process")
    network: Literal["public", "sandbox"] = Field(
        "public", description="ray_sandbox network mode of sandboxes whose phases need a network")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each sandbox also reserves")
    placement_timeout_sec: float | None = Field(
        None, description="give up when the cluster cannot place a sandbox for this long")
    sandbox: dict[str, Any] = Field(
        default_factory=dict, description="more SandboxConfig fields for every sandbox, e.g. "
        '--ek sandbox=\'{"pids_limit": 256, "directfs": false}\'; the task sets '
        + ", ".join(_TASK_FIELDS))

    @field_validator("sandbox")
    @classmethod
    def _sandbox_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Values are validated with the task's fields in _template (dns= needs the network
        # the task gives); names now, so that a typo fails the job before any trial.
        if unknown := sorted(v.keys() - SandboxConfig.model_fields.keys()):
            raise ValueError(f"unknown sandbox option(s) {', '.join(unknown)}")
        if owned := sorted(v.keys() & set(_TASK_FIELDS)):
            raise ValueError(f"sandbox option(s) {', '.join(owned)} come from the task")
        return v


_ray_lock = threading.Lock()
_builder_lock = threading.Lock()
_builder: SandboxRuntime | None = None


def _build_runtime() -> SandboxRuntime:
    """The runtime this process builds task Dockerfiles with: its own home beside the
    node's, the node's image store (the built images and ray-sandbox/docker are cached
    there for every trial)."""
    global _builder
    with _builder_lock:
        if _builder is None:
            _builder = SandboxRuntime(paths.home() / "harbor-builds", images=ImageStore())
        return _builder


def _image_tag(task_name: str) -> str:
    """A Docker image name for a task's built image (lowercase, Docker's characters)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", task_name.lower()).strip(".-_") or "task"
    return f"harbor/{name[:100]}:latest"


def _join_ray(address: str | None) -> None:
    """Join (or start) the Ray cluster once per process; trials share it."""
    with _ray_lock:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)


@ray.remote(num_cpus=0)
def _node_problems() -> list[str]:
    """What keeps this node from running sandboxes as the environment promises (limits need
    root and cgroups; mmdebstrap only builds the default image)."""
    problems = [f"{c.name}: {c.detail}" for c in diagnose().checks
                if not c.ok and c.name != "mmdebstrap"]
    if os.geteuid() != 0:
        problems.append("not root: sandboxes would run rootless, without CPU/memory limits")
    return problems


class RaySandboxEnvironment(BaseEnvironment):
    """Runs each trial in a gVisor sandbox created through ``ray_sandbox.create``.

    Runs ``[environment].docker_image`` (any reference the node's image store can pull: a
    registry, ``oci:``, ``oci-archive:``, ``docker-archive:``), or builds
    ``environment/Dockerfile`` once per node inside gVisor (``runtime.docker.build_image``,
    cached by content), or a Compose task's services with Docker inside the trial's
    sandbox, ``exec`` and files going to its ``main`` service (``_compose``). CPU and
    memory are reserved in Ray and enforced with cgroups; ``storage_mb`` is ``disk=``.
    """

    options_model = RaySandboxOptions
    options: RaySandboxOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sandbox: SandboxHandle | None = None
        self._shell: str | None = None
        self._image: str | None = self.task_env_config.docker_image
        # A Compose task: one Docker sandbox runs the services, exec goes to `main`.
        self._compose = (not self._image
                         and (self.environment_dir / "docker-compose.yaml").is_file())
        self._main: str | None = None  # the main service's container id
        # A built image is an archive on the node that built it: its trials run there.
        self._node: str | None = None
        self._main_shell = "/bin/sh"
        self._main_timeout = False  # whether main has timeout(1)
        policies = [self._network_policy, *self._phase_network_policies]
        self._mode = _policy.start_mode(policies, self.options.network)

    @staticmethod
    def type() -> str:
        return "ray-sandbox"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            dynamic_network_policy=True,  # nft rules replaced in place, outside gVisor
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # Requests are Ray placement-group reservations; limits are cgroup limits.
        return EnvironmentResourceCapabilities(
            cpu_limit=True, cpu_request=True, memory_limit=True, memory_request=True,
            fractional_cpus=True,
        )

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Join the Ray cluster and check every alive node for runsc, the image tools, the
        agent, cgroups and root."""
        super().preflight(kwargs)
        options = cls.parse_options(kwargs)
        assert isinstance(options, RaySandboxOptions)
        try:
            _join_ray(options.ray_address)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise SystemExit(f"cannot join the Ray cluster: {exc}") from None
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        checks = [_node_problems.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id=node, soft=False)).remote() for node in nodes]
        found = {node: p for node, p in zip(nodes, ray.get(checks), strict=True) if p}
        if found:
            detail = "; ".join(f"node {node[:8]}: {', '.join(p)}" for node, p in found.items())
            raise SystemExit(f"ray_sandbox cannot run sandboxes (run scripts/setup.sh): {detail}")

    def _validate_definition(self) -> None:
        if self.task_env_config.docker_image:
            return
        compose = self.environment_dir / "docker-compose.yaml"
        if compose.is_file():
            _compose.rewrite(yaml.safe_load(compose.read_text()) or {})  # needs a main
            return
        if not (self.environment_dir / "Dockerfile").is_file():
            raise ValueError("the ray-sandbox environment needs [environment].docker_image "
                             "in task.toml or an environment/Dockerfile")

    def _build_image(self) -> str:
        """Build environment/Dockerfile in a gVisor build sandbox on this node (once: later
        trials and runs get the cached image); returns the image's reference."""
        image = docker.build_image(
            _build_runtime(), self.environment_dir, tag=_image_tag(self.environment_name),
            progress=lambda line: self.logger.debug(f"[build] {line}"))
        return image.ref

    # --- lifecycle -----------------------------------------------------------------------------

    def _template(self) -> SandboxTemplate:
        cpu_limit = self._resource_limit_value("cpu", auto_mode=ResourceMode.GUARANTEE)
        cpu_request = self._resource_request_value("cpu", auto_mode=ResourceMode.GUARANTEE)
        mem_limit = self._resource_limit_value("memory", auto_mode=ResourceMode.GUARANTEE)
        mem_request = self._resource_request_value("memory", auto_mode=ResourceMode.GUARANTEE)
        storage_mb = self._effective_storage_mb
        memory = mem_limit * 2**20 if mem_limit else None
        compose = {}
        if self._compose:  # dockerd and every service share the sandbox's limits
            compose = {"docker": True}
            memory = None if memory is None else max(memory, _COMPOSE_MIN_MEMORY)
        config = make_config(
            self.options.sandbox,
            image=docker.DOCKER_IMAGE if self._compose else self._image,
            cpu=cpu_limit,
            memory=memory,
            disk=storage_mb * 2**20 if storage_mb else None,
            env={} if self._compose else self._startup_env(),
            workdir=None if self._compose else self.task_env_config.workdir,
            **compose,
            readonly=False,
            timeout_seconds=None,  # Harbor's timeout_sec=None means no timeout
            network=self._mode,
            egress=_policy.egress(self._network_policy) if self._mode != "none" else None,
            labels={"ray-sandbox/harbor-session": self.session_id},
        )
        # Ray reserves the request. Without one the template reserves the limit, as placement
        # needs a reservation; with one and no limit, nothing caps the sandbox.
        resources = dict(self.options.resources)
        if cpu_request is not None:
            resources["CPU"] = float(cpu_request)
        if mem_request is not None:
            resources["memory"] = float(mem_request * 2**20)
        return SandboxTemplate(config=config, resources=resources, node_id=self._node)

    async def start(self, force_build: bool) -> None:
        if self._image is None and not self._compose:  # a Dockerfile task: built (or
            self._image = await asyncio.to_thread(self._build_image)  # cached) here
            await asyncio.to_thread(_join_ray, self.options.ray_address)
            self._node = ray.get_runtime_context().get_node_id()
        template = self._template()

        def create() -> SandboxHandle:
            _join_ray(self.options.ray_address)
            return create_from_template(template, timeout=self.options.placement_timeout_sec)

        self._sandbox = await asyncio.to_thread(create)
        try:
            # Harbor's agents rely on bash (pipefail, arrays) where the image has it.
            has_bash = await self._sandbox.exists.remote("/bin/bash")
            self._shell = "/bin/bash" if has_bash else None
            if self._compose:
                await self._compose_up()
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self.stop(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is None:
            return
        if not delete:
            self.logger.info(f"keeping sandbox {sandbox.sandbox_id}; it ends with the Ray job")
            return
        try:
            await sandbox.terminate.remote()
        except RayError as exc:
            self.logger.error(f"deleting sandbox {sandbox.sandbox_id} failed: {exc}")

    # --- compose tasks -------------------------------------------------------------------------

    async def _outer(self, command: str, what: str, timeout: float | None = 1800) -> str:
        """Run ``command`` in the sandbox itself (not in a service); its stdout, or a
        RuntimeError naming ``what`` with the output's tail."""
        res: SandboxExecResult = await self._require().exec.remote(
            command, shell=self._shell, timeout=timeout)
        if res.exit_code != 0 or res.timed_out:
            raise RuntimeError(f"{what} failed (exit {res.exit_code}): "
                               f"{(res.stdout + res.stderr)[-3000:]}")
        return res.stdout

    async def _compose_up(self) -> None:
        """Load the images the compose file needs from the node's store, start every
        service on the sandbox's network, and find the main service's container."""
        env_dir = self.environment_dir
        spec = yaml.safe_load((env_dir / "docker-compose.yaml").read_text()) or {}

        def dockerfile(context: str, name: str) -> str:
            return (env_dir / context / name).read_text()

        store = ImageStore()
        outer = self._require()
        await self._outer("mkdir -p /rsb/xfer", "preparing the sandbox")
        await self._transfer(outer.upload_dir, env_dir, _compose.ENV_DIR)
        for i, ref in enumerate(_compose.build_bases(spec, dockerfile)):
            image = await asyncio.to_thread(store.get, ref)
            with tempfile.TemporaryDirectory(prefix="rsb-compose-") as tmp:
                tar = Path(tmp) / "base.tar"
                await asyncio.to_thread(export_layout, Path(image.rootfs).parent / "oci",
                                        "image", f"docker-archive:{tar}:{ref}")
                await self._transfer(outer.upload_file, tar, f"/rsb/base{i}.tar")
            await self._outer(f"docker load -q -i /rsb/base{i}.tar && rm /rsb/base{i}.tar",
                              f"docker load of {ref}")
        rewritten = yaml.safe_dump(_compose.rewrite(spec))
        await self._require().write_file.remote(_compose.COMPOSE_FILE, rewritten.encode())
        compose = (f"cd {_compose.ENV_DIR} && docker-compose -p {_compose.PROJECT} "
                   f"-f {_compose.COMPOSE_FILE}")
        await self._outer(f"{compose} up -d --build 2>&1", "docker-compose up")
        self._main = (await self._outer(f"{compose} ps -q {_compose.MAIN}",
                                        "finding the main service")).strip()
        if not self._main:
            raise RuntimeError("docker-compose started no main service")
        probe = await self._outer(
            f"docker exec {self._main} sh -c 'echo bash=$(command -v bash); "
            "echo timeout=$(command -v timeout)'", "probing the main service")
        found = dict(line.split("=", 1) for line in probe.splitlines() if "=" in line)
        self._main_shell = "bash" if found.get("bash") else "sh"
        self._main_timeout = bool(found.get("timeout"))

    def _scratch(self) -> str:
        return f"/rsb/xfer/{uuid.uuid4().hex}"

    def _require(self) -> SandboxHandle:
        if self._sandbox is None:
            raise RuntimeError("the sandbox is not running: call start() first")
        return self._sandbox

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        sandbox = self._require()
        if self._mode == "none":
            raise ValueError("the sandbox started without a network (every phase declared "
                             "no-network), so it cannot switch to another policy")
        await sandbox.set_egress.remote(_policy.egress(network_policy))

    # --- exec ----------------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` through bash (sh when the image has no bash). A non-zero exit is a
        result; a timeout kills every process of the command and returns exit code 124."""
        user = self._resolve_user(user)
        kwargs = dict(cwd=cwd, env=self._merge_env(env), shell=self._shell, timeout=timeout_sec,
                      user=None if user is None else str(user))
        if self._main is not None:  # a Compose task: in the main service's container
            inner = timeout_sec if self._main_timeout else None
            command = _compose.exec_command(
                self._main, command, shell=self._main_shell,
                cwd=cwd or self.task_env_config.workdir, env=kwargs["env"],
                user=kwargs["user"], timeout=inner)
            kwargs.update(cwd=None, env=None, user=None)
            if inner is not None:
                kwargs["timeout"] = inner + _compose.TIMEOUT_GRACE_S
        callback = self._output_callback()
        if callback is None:
            res: SandboxExecResult = await self._require().exec.remote(command, **kwargs)
            stdout, stderr = res.stdout, res.stderr
        else:  # stream the output to Harbor's log subscribers as it arrives
            streams = {"stdout": bytearray(), "stderr": bytearray()}
            async for ref in self._require().exec_stream.remote(command, **kwargs):
                item = await ref
                if isinstance(item, OutputChunk):
                    streams[item.stream] += item.data
                    await callback(item.text, item.stream)
                else:
                    res = item
            stdout, stderr = (streams[s].decode(errors="replace") for s in ("stdout", "stderr"))
        if res.timed_out:
            stderr += f"\n[ray-sandbox] command timed out after {timeout_sec} s\n"
        return ExecResult(stdout=stdout, stderr=stderr,
                          return_code=TIMEOUT_EXIT_CODE if res.timed_out else res.exit_code)

    # --- files ---------------------------------------------------------------------------------

    @staticmethod
    async def _transfer(method: Any, source: Path | str, target: Path | str) -> None:
        """The handle's transfer methods read or write the local path during ``.remote()``,
        so they run in a thread."""
        await asyncio.to_thread(lambda: ray.get(method.remote(source, target)))

    # A Compose task's files move through a scratch path of the sandbox and `docker cp`.

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        if self._main is None:
            await self._transfer(self._require().upload_file, source_path, target_path)
            return
        scratch = self._scratch()
        await self._transfer(self._require().upload_file, source_path, scratch)
        parent = os.path.dirname(target_path) or "/"
        await self._outer(f"docker exec {self._main} mkdir -p {shlex.quote(parent)} && "
                          f"docker cp {scratch} {self._main}:{shlex.quote(target_path)} && "
                          f"rm -f {scratch}", "upload into the main service")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        if self._main is None:
            await self._transfer(self._require().upload_dir, source_dir, target_dir)
            return
        scratch = self._scratch()
        await self._transfer(self._require().upload_dir, source_dir, scratch)
        await self._outer(f"docker exec {self._main} mkdir -p {shlex.quote(target_dir)} && "
                          f"docker cp {scratch}/. {self._main}:{shlex.quote(target_dir)} && "
                          f"rm -rf {scratch}", "upload into the main service")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        sandbox = self._require()
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if self._main is None:
            await self._transfer(sandbox.download_file, source_path, target)
            return
        scratch = self._scratch()
        await self._outer(f"mkdir -p /rsb/xfer && docker cp "
                          f"{self._main}:{shlex.quote(source_path)} {scratch}",
                          "download from the main service")
        await self._transfer(sandbox.download_file, scratch, target)
        await self._outer(f"rm -rf {scratch}", "cleaning up")

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        if self._main is None:
            await self._transfer(self._require().download_dir, source_dir, target_dir)
            return
        scratch = self._scratch()
        await self._outer(f"mkdir -p {scratch} && docker cp "
                          f"{self._main}:{shlex.quote(source_dir)}/. {scratch}",
                          "download from the main service")
        await self._transfer(self._require().download_dir, scratch, target_dir)
        await self._outer(f"rm -rf {scratch}", "cleaning up")
