"""Offline validation of the KubeRay deployment (kuberay/): no cluster is reachable from CI.

- Every manifest is validated against the ``openAPIV3Schema`` of the KubeRay CRDs kept in
  ``../shared/kuberay`` (the API server's own check), made strict: unknown fields are errors,
  as with ``kubectl apply --validate=strict``. CEL rules (``x-kubernetes-validations``) are not
  evaluated offline, so the manifests must not use the fields that carry them.
- Kubernetes object rules the schema does not express: names, unique container names,
  quantities that parse and requests <= limits, volume mounts that name volumes.
- Consistency with the repository: images are the Dockerfile's build target at the project
  version, the scripts the pods run exist and are in the image, the custom resource is the one
  the docs name, the RayJob's arguments exist in the example and its image is pre-pulled.
- Drift guard: the Dockerfile installs only by running ``scripts/setup.sh``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "kuberay"
SHARED = REPO.parent / "shared" / "kuberay"  # CI keeps a copy of shared/ beside its clone
MANIFESTS = {"raycluster.yaml": "RayCluster", "rayjob.yaml": "RayJob"}
CRDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
IMAGE_ROOT = "/opt/ray_sandbox/src"  # where kuberay/Dockerfile copies the repository
SLOT = "sandbox_slot"

needs_crds = pytest.mark.skipif(
    not all((SHARED / f).is_file() for f in CRDS.values()),
    reason=f"KubeRay CRD schemas not found in {SHARED} (shared/ is laid beside the repository)",
)

# --- a strict OpenAPI v3 structural-schema validator ----------------------------------------


def strict(schema: Any) -> Any:
    """OpenAPI v3 (Kubernetes structural schema) -> JSON Schema draft 7, strict.

    ``nullable`` becomes a null type; an object schema with ``properties`` and no
    ``additionalProperties`` rejects other keys unless ``x-kubernetes-preserve-unknown-fields``
    says the server keeps them (the server prunes or, with strict field validation, rejects
    them). ``x-kubernetes-int-or-string`` is spelled as anyOf in these CRDs already; other
    ``x-kubernetes-*`` keys and ``format`` are ignored by the draft-7 validator, int32/int64
    formats are checked by :data:`FORMATS`.
    """
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("items", "not", "additionalProperties") else v
           for k, v in schema.items() if k not in ("properties", "anyOf", "allOf", "oneOf")}
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = strict(schema[key])
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if ("additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def load_crd(kind: str) -> dict:
    return yaml.safe_load((SHARED / CRDS[kind]).read_text())


def crd_version(crd: dict, api_version: str) -> dict:
    group, _, version = api_version.partition("/")
    assert group == crd["spec"]["group"], f"apiVersion group {group!r}"
    found = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert found and found[0]["served"], f"{api_version} is not a served version"
    return found[0]


def schema_errors(doc: dict, crd: dict) -> list[str]:
    schema = strict(crd_version(crd, doc["apiVersion"])["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft7Validator(schema, format_checker=FORMATS)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(doc))


def cel_fields(doc: Any, schema: dict, path: str = "") -> Iterator[str]:
    """Paths in ``doc`` whose schema carries CEL rules (not evaluated offline)."""
    if schema.get("x-kubernetes-validations"):
        yield path or "<root>"
    if isinstance(doc, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in doc.items():
            sub = props.get(k, extra if isinstance(extra, dict) else None)
            if sub:
                yield from cel_fields(v, sub, f"{path}.{k}" if path else k)
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(doc):
            yield from cel_fields(v, schema["items"], f"{path}[{i}]")


# --- Kubernetes object rules -----------------------------------------------------------------

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][-+]?[0-9]+|[numkMGTPE]i?|Ki)?$")
_SUFFIX = {
    None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
    "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
    "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity (``"500m"``, ``"112Gi"``, ``2``) as a number."""
    text = str(value)
    m = _QUANTITY.match(text)
    if not m or m.group(1).count(".") > 1 or m.group(1) in ("", ".", "+", "-"):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = Decimal(m.group(1)), m.group(2)
    if suffix and suffix[0] in "eE":
        return number * Decimal(10) ** int(suffix[1:])
    if suffix not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return number * _SUFFIX[suffix]


def pod_specs(doc: dict) -> Iterator[tuple[str, dict]]:
    spec = doc["spec"]
    cluster = spec.get("rayClusterSpec") or (spec if doc["kind"] == "RayCluster" else None)
    if cluster:
        yield "head", cluster["headGroupSpec"]["template"]["spec"]
        for g in cluster.get("workerGroupSpecs", []):
            yield g["groupName"], g["template"]["spec"]
    if "submitterPodTemplate" in spec:
        yield "submitter", spec["submitterPodTemplate"]["spec"]


def all_containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def object_rule_errors(doc: dict) -> list[str]:
    errors = []
    name = doc["metadata"]["name"]
    if len(name) > 63 or not DNS1035_LABEL.match(name) or not DNS1123_SUBDOMAIN.match(name):
        # RayCluster/RayJob names become Service and Pod name prefixes (DNS-1035 labels).
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label of <= 63 characters")
    for where, pod in pod_specs(doc):
        names = [c["name"] for c in all_containers(pod)]
        if len(names) != len(set(names)):
            errors.append(f"{where}: container names not unique: {names}")
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for c in all_containers(pod):
            if not DNS1123_LABEL.match(c["name"]):
                errors.append(f"{where}/{c['name']}: container name is not a DNS-1123 label")
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r, q in res.get(kind, {}).items():
                    try:
                        quantity(q)
                    except ValueError as exc:
                        errors.append(f"{where}/{c['name']} {kind}.{r}: {exc}")
            for r, q in res.get("requests", {}).items():
                lim = res.get("limits", {}).get(r)
                if lim is not None and quantity(q) > quantity(lim):
                    errors.append(f"{where}/{c['name']}: request {r}={q} above limit {lim}")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    errors.append(f"{where}/{c['name']}: mounts undeclared volume {m['name']}")
    return errors


# --- the repository side ---------------------------------------------------------------------


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]


def manifest(name: str) -> dict:
    (doc,) = docs(name)
    return doc


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (KUBERAY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line[:-1].strip()}" if line.endswith("\\") else f"{pending} {line}"
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def build_targets() -> set[str]:
    return {m.group(1) for op, args in dockerfile_instructions() if op == "FROM"
            for m in [re.search(r"\bAS\s+(\S+)$", args, re.IGNORECASE)] if m}


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def worker_group(cluster: dict) -> dict:
    (group,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "sandbox"]
    return group


def ray_start_resources(params: dict[str, str]) -> dict[str, float]:
    """KubeRay passes ``rayStartParams.resources`` verbatim to ``ray start --resources``; its
    documented form is a quoted JSON string, i.e. JSON inside a JSON string literal."""
    value = json.loads(params["resources"])
    return json.loads(value) if isinstance(value, str) else value


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# --- tests: the validator itself ------------------------------------------------------------


@needs_crds
@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(rayStartParam={}),
     "Additional properties are not allowed ('rayStartParam'"),
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(maxReplicas="100"), "is not of type"),
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(maxReplicas=2**31), "int32"),
    (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required"),
    (lambda d: d["spec"]["autoscalerOptions"].update(version="v3"), "'v3' is not one of"),
    (lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
     ["limits"].update(memory="56GB"), "does not match"),
    (lambda d: d["spec"]["workerGroupSpecs"][0]["rayStartParams"].update(**{"num-cpus": 4}),
     "is not of type 'string'"),
])
def test_validator_rejects_what_the_api_server_rejects(mutate: Any, expected: str) -> None:
    doc = manifest("raycluster.yaml")
    mutate(doc)
    errors = schema_errors(doc, load_crd("RayCluster"))
    assert any(expected in e for e in errors), errors


def test_quantity_parser() -> None:
    assert quantity("500m") == Decimal("0.5")
    assert quantity("112Gi") == 112 * 2**30
    assert quantity(2) == 2 and quantity("1e3") == 1000 and quantity("1.5k") == 1500
    for bad in ("56GB", "1..2", "Gi", "", "1 Gi"):
        with pytest.raises(ValueError):
            quantity(bad)


# --- tests: the manifests -------------------------------------------------------------------


@needs_crds
@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_matches_the_crd_schema(name: str) -> None:
    doc = manifest(name)
    assert doc["kind"] == MANIFESTS[name]
    crd = load_crd(doc["kind"])
    assert crd["spec"]["names"]["kind"] == doc["kind"]
    assert schema_errors(doc, crd) == []
    schema = crd_version(crd, doc["apiVersion"])["schema"]["openAPIV3Schema"]
    unchecked = list(cel_fields(doc, schema))
    assert unchecked == [], f"fields with CEL rules, not validated offline: {unchecked}"


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_follows_kubernetes_object_rules(name: str) -> None:
    assert object_rule_errors(manifest(name)) == []


def test_object_rules_catch_mistakes() -> None:
    doc = manifest("raycluster.yaml")
    pod = worker_group(doc)["template"]["spec"]
    pod["initContainers"][0]["name"] = pod["containers"][0]["name"]
    pod["containers"][0]["resources"]["requests"]["cpu"] = "64"
    pod["containers"][0]["volumeMounts"].append({"name": "nope", "mountPath": "/x"})
    doc["metadata"]["name"] = "Ray_Sandbox"
    text = "\n".join(object_rule_errors(doc))
    for expected in ("not unique", "above limit", "undeclared volume nope", "DNS-1035"):
        assert expected in text


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_images_are_the_dockerfile_target_at_the_project_version(name: str) -> None:
    targets = build_targets()
    assert targets, "kuberay/Dockerfile names no build target (FROM ... AS name)"
    for where, pod in pod_specs(manifest(name)):
        for c in all_containers(pod):
            repo, _, tag = c["image"].rpartition(":")
            assert repo.rsplit("/", 1)[-1] in targets, f"{where}/{c['name']}: {c['image']}"
            assert tag == project_version(), f"{where}/{c['name']}: tag {tag}"


def test_ray_version_is_the_pinned_one() -> None:
    cluster = manifest("raycluster.yaml")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    # Ray is the "ray" extra; every extra that brings it pins the same version
    pins = {re.search(r"==(\d+\.\d+)", d).group(1)
            for deps in extras.values() for d in deps if re.match(r"ray(\[|==)", d)}
    assert len(pins) == 1 and any(d.startswith("ray[") for d in extras["ray"]), pins
    (major_minor,) = pins
    assert cluster["spec"]["rayVersion"].startswith(major_minor + "."), pins


def test_sandbox_capacity_is_advertised_as_documented() -> None:
    cluster = manifest("raycluster.yaml")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["autoscalerOptions"]["version"] == "v2"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    group = worker_group(cluster)
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group.get("idleTimeoutSeconds", 0) > 0
    resources = ray_start_resources(group["rayStartParams"])
    assert list(resources) == [SLOT] and resources[SLOT] > 0
    from benchmarks.bench_scale import SLOT as bench_slot

    assert bench_slot == SLOT
    for doc in ("kuberay.md", "scale.md"):
        assert f"`{SLOT}`" in (REPO / "docs" / doc).read_text(), f"docs/{doc} must name {SLOT}"


def test_worker_probe_port_is_the_agent_port_ray_is_told() -> None:
    group = worker_group(manifest("raycluster.yaml"))
    port = int(group["rayStartParams"]["dashboard-agent-listen-port"])
    (ray,) = group["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert ray[probe]["httpGet"]["port"] == port


def test_pod_scripts_exist_and_are_in_the_image() -> None:
    copied = [src for op, args in dockerfile_instructions() if op == "COPY"
              for src in args.split()[:-1]]
    group = worker_group(manifest("raycluster.yaml"))
    pod = group["template"]["spec"]
    assert group["template"]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    commands = [" ".join(c.get("command", []) + c.get("args", [])) for c in all_containers(pod)]
    scripts = [p for cmd in commands for p in re.findall(rf"{IMAGE_ROOT}/(\S+\.sh)", cmd)]
    assert {"kuberay/node-init.sh", "kuberay/entrypoint.sh"} <= set(scripts)
    for script in scripts:
        assert (REPO / script).is_file(), script
        assert any(script.startswith(c.rstrip("/") + "/") for c in copied), f"{script} not copied"
        subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    assert "KUBERAY_GEN_RAY_START_CMD" in (KUBERAY / "entrypoint.sh").read_text()


def test_state_and_image_cache_are_volumes_not_the_container_rootfs() -> None:
    """Sandbox roots are overlay mounts: their upper and lower layers cannot be on the
    container's overlayfs rootfs."""
    pod = worker_group(manifest("raycluster.yaml"))["template"]["spec"]
    for c in all_containers(pod):
        env = env_of(c)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert env["RAY_SANDBOX_HOME"] in mounts and env["RAY_SANDBOX_IMAGES"] in mounts


def test_rayjob_runs_the_rollout_example_on_the_cluster() -> None:
    job, cluster = manifest("rayjob.yaml"), manifest("raycluster.yaml")
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python" and argv[1].startswith(IMAGE_ROOT + "/")
    script = REPO / argv[1].removeprefix(IMAGE_ROOT + "/")
    assert script.is_file()
    helptext = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                              text=True, check=True, timeout=120).stdout
    flags = [a for a in argv[2:] if a.startswith("--")]
    assert flags and all(f in helptext for f in flags), (flags, helptext)
    image = argv[argv.index("--image") + 1]
    pod = worker_group(cluster)["template"]["spec"]
    warm = env_of(pod["initContainers"][0]).get("RAY_SANDBOX_WARM_IMAGES", "").split()
    assert image in warm, "the rollout's image must be pre-pulled on every worker"


# --- tests: the image -----------------------------------------------------------------------


def test_dockerfile_installs_only_through_setup_sh() -> None:
    """Drift guard: the image gets its packages, agent and Python environment from exactly
    the script every developer machine and CI run, and from nothing else."""
    runs = [args for op, args in dockerfile_instructions() if op == "RUN"]
    setup = [r for r in runs if "setup.sh" in r]
    assert setup == [f"bash {IMAGE_ROOT}/scripts/setup.sh"], setup
    installers = re.compile(r"\b(apt-get|apt|dpkg|pip3?|uv|conda|make|curl|wget|gcc|"
                            r"git|mmdebstrap)\b")
    for r in runs:
        if r not in setup:
            assert not installers.search(r), f"installs outside setup.sh: RUN {r}"
    assert (REPO / "scripts" / "setup.sh").is_file()


def test_dockerfile_base_is_a_distribution_setup_sh_supports() -> None:
    ops = dockerfile_instructions()
    args = dict(a.split("=", 1) for op, a in ops if op == "ARG" and "=" in a)
    (base,) = [a.split()[0] for op, a in ops if op == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    codename = re.match(r"debian:(\w+)", base)
    assert codename, f"base {base} is not Debian: setup.sh installs runsc from Debian"
    assert re.search(rf"^\s*(\w+\|)*{codename.group(1)}(\|\w+)*\)", setup, re.MULTILINE), base


def test_dockerfile_venv_is_on_path_for_login_shells() -> None:
    ops = dockerfile_instructions()
    env = " ".join(a for op, a in ops if op == "ENV")
    venv = re.search(r"RAY_SANDBOX_VENV=(\S+)", env).group(1)
    assert f"PATH={venv}/bin:" in env
    assert any(op == "RUN" and "/etc/profile.d/" in a and f"{venv}/bin" in a for op, a in ops)


# --- heavy: the Dockerfile replayed without a Docker engine ----------------------------------

_IGNORE = [line.strip() for line in (KUBERAY / "Dockerfile.dockerignore").read_text().splitlines()
           if line.strip() and not line.startswith("#")]


def _ignored(rel: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(rel, p) or fnmatch(rel, p.removeprefix("**/"))
               or any(fnmatch(part, p.removeprefix("**/")) for part in rel.split("/"))
               for p in _IGNORE)


def _copy_context(src: str, dest: Path) -> None:
    """COPY <src> <dest> from the repository, minus what the dockerignore file drops."""
    import shutil

    path = REPO / src.rstrip("/")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        rel = f.relative_to(REPO).as_posix()
        if _ignored(rel):
            continue
        target = dest / f.name if path.is_file() else dest / f.relative_to(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)


def replay_script(rootfs: Path) -> str:
    """Bash that replays kuberay/Dockerfile's ENV and RUN steps on ``rootfs`` (COPY is done by
    the caller) and then, with the tree pivoted to as root like a container's, runs sandboxes.
    Any instruction it does not know fails the test, so the replay follows the Dockerfile."""
    env: dict[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                           "HOME": "/root"}
    lines = ["set -euo pipefail", f"R={shlex.quote(str(rootfs))}",
             "mount -t proc proc $R/proc", "mount --rbind /sys $R/sys",
             "mount --rbind /dev $R/dev"]
    build_ca = next((os.environ[v] for v in ("PIP_CERT", "SSL_CERT_FILE") if v in os.environ),
                    None)
    if build_ca:  # a build network that intercepts TLS (this workplace); not part of the image
        lines.append(f"cp {shlex.quote(build_ca)} $R/tmp/build-ca.crt")
    for op, args in dockerfile_instructions():
        if op == "ENV":
            for k, v in (kv.split("=", 1) for kv in shlex.split(args)):
                env[k] = re.sub(r"\$(\w+)|\$\{(\w+)\}",
                                lambda m: env.get(m.group(1) or m.group(2), ""), v)
        elif op == "RUN":
            run_env = {**env, **({"PIP_CERT": "/tmp/build-ca.crt"} if build_ca else {})}
            assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in run_env.items())
            lines.append(f"chroot $R /usr/bin/env -i {assigns} /bin/sh -c {shlex.quote(args)}")
        elif op not in ("ARG", "FROM", "COPY", "WORKDIR"):
            raise AssertionError(f"the replay does not know {op}; teach it")
    smoke = ("umount -l /.oldroot && cd / && ray-sandbox image build busybox >/dev/null"
             " && ray-sandbox run -i ray-sandbox/busybox -- echo sandbox-in-image"
             " && ray-sandbox run -i ray-sandbox/busybox --network public -- ip -o addr"
             " && ray-sandbox gc && bash -lc 'command -v ray'")
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # rbind: a plain bind of $R onto itself would hide the proc/sys/dev mounts beneath it.
    lines += ["mount --rbind $R $R", "mkdir -p $R/.oldroot", "cd $R",
              "pivot_root . .oldroot",
              f"exec /usr/bin/env -i {assigns} /bin/bash -c {shlex.quote(smoke)}"]
    return "\n".join(lines)


@pytest.mark.heavy
@pytest.mark.skipif(not os.environ.get("RAY_SANDBOX_HEAVY"), reason="heavy: RAY_SANDBOX_HEAVY=1")
@pytest.mark.timeout(1800)
def test_dockerfile_replayed_on_debian_runs_sandboxes(tmp_path: Path) -> None:
    """No Docker engine here: build the base with mmdebstrap (minbase, deb822 sources like the
    debian:*-slim images), COPY from the repository through the dockerignore file, run every
    RUN with the Dockerfile's ENV in a chroot, then pivot into the tree (as a privileged
    container's root) and run sandboxes with network none and public. Needs Debian's mirror
    and PyPI; ~3 min."""
    ops = dockerfile_instructions()
    args = dict(a.split("=", 1) for op, a in ops if op == "ARG" and "=" in a)
    (base,) = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], a.split()[0])
               for op, a in ops if op == "FROM"]
    codename = re.match(r"debian:(\w+)(-slim)?$", base).group(1)
    rootfs = tmp_path / "rootfs"
    sources = (f"Types: deb\\nURIs: http://deb.debian.org/debian\\n"
               f"Suites: {codename} {codename}-updates\\nComponents: main\\n"
               "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\\n")
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--mode=root",
                    f"--customize-hook=rm -f \"$1/etc/apt/sources.list\"; printf '{sources}' > "
                    "\"$1/etc/apt/sources.list.d/debian.sources\"", codename, str(rootfs)],
                   check=True, timeout=900)
    for op, a in ops:
        if op == "COPY":
            *srcs, dest = a.split()
            for src in srcs:
                _copy_context(src, rootfs / dest.lstrip("/"))
    script = tmp_path / "replay.sh"
    script.write_text(replay_script(rootfs))
    try:  # mounts live in the private mount namespace and end with it
        res = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", str(script)],
                             capture_output=True, text=True, timeout=1500)
    finally:
        import shutil

        shutil.rmtree(rootfs, ignore_errors=True)  # ~1 GiB: pytest keeps its tmp dirs
    assert res.returncode == 0, res.stdout[-2000:] + "\n--- stderr ---\n" + res.stderr[-2000:]
    assert "sandbox-in-image" in res.stdout
    assert "tap0" in res.stdout  # network="public": slirp4netns inside the image works
    assert res.stdout.strip().endswith("/opt/ray_sandbox/venv/bin/ray")
