#!/usr/bin/env bash
# One idempotent setup for a fresh Debian 12 (bookworm) or 13 (trixie) machine, run as root:
# system packages (runsc 0.0~20240729 included), the in-sandbox agent, and the project venv.
# Both README commands and .ci/run start with it; a second run is a no-op in a few seconds.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RAY_SANDBOX_VENV:-$ROOT/.venv}
RUNSC_WANT=0.0~20240729
# e2fsprogs: mkfs.ext4 formats the size-capped filesystem behind disk= (runtime/disk.py).
# postgresql: the tests start a private PostgreSQL of their own for the service's books
# (tests/fx_postgres.py: Debian's initdb and pg_ctl, a data directory and port under /tmp).
PACKAGES=(
  runsc umoci skopeo slirp4netns uidmap mmdebstrap docker-registry busybox-static
  iproute2 nftables util-linux procps psmisc gcc libc6-dev make erofs-utils e2fsprogs
  python3 python3-venv ca-certificates curl postgresql
)

log() { printf '[setup] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "run as root (the sandbox runtime needs it)"; exit 1; }
. /etc/os-release
export DEBIAN_FRONTEND=noninteractive

# Not `runsc --version | grep -q`: grep -q exits at the first match, runsc may then die of
# SIGPIPE, and pipefail turns that into "wrong version" (seen: a needless reinstall).
runsc_ok() { command -v runsc >/dev/null && [[ "$(runsc --version 2>/dev/null)" == *"$RUNSC_WANT"* ]]; }

missing=()
for p in "${PACKAGES[@]}"; do
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == "install ok installed" ]] || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ] || ! runsc_ok; then
  case "${VERSION_CODENAME:-}" in
    bookworm)
      # runsc in bookworm is 20221219 (no systrap, no file control socket, blocking
      # checkpoint --leave-running); backports has the 20240729 build we target.
      uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
      uri=${uri:-http://deb.debian.org/debian}
      cat > /etc/apt/sources.list.d/ray-sandbox-backports.sources <<SRC
Types: deb
URIs: $uri
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
      # Only runsc may come from backports.
      cat > /etc/apt/preferences.d/ray-sandbox-backports <<PIN
Package: *
Pin: release n=bookworm-backports
Pin-Priority: 100

Package: runsc
Pin: release n=bookworm-backports
Pin-Priority: 990
PIN
      ;;
    trixie|forky|sid) ;;
    *) log "untested distribution '${VERSION_CODENAME:-unknown}'; trying its own packages" ;;
  esac
  # Debian's postgresql makes and starts a cluster of the machine's own when installed; the
  # tests need only its binaries, so none is made (an existing cluster is left as it is).
  if [ ! -d /etc/postgresql ]; then
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/ray-sandbox.conf
  fi
  log "installing system packages: ${missing[*]:-runsc}"
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
  runsc_ok || { log "runsc is $(runsc --version 2>&1 | head -1), want $RUNSC_WANT"; exit 1; }
fi

# The agent is a static C binary bind-mounted read-only into every sandbox; built from the
# repo's source so no prebuilt binary is ever downloaded.
make -s -C "$ROOT/ray_sandbox/runtime/agent"

# The venv: reinstalled only when pyproject.toml changes.
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv at $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.ray_sandbox-installed"
want=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing ray_sandbox and its dev dependencies into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,ray,mcp,service,modal]"
  echo "$want" > "$stamp"
fi
# Harbor needs Python >= 3.12 and stays out of the core venv. Debian 12 ships only 3.11, so
# this venv exists only where a newer interpreter does (Debian 13, pyenv); its tests skip
# otherwise and say why.
HARBOR_VENV=${RAY_SANDBOX_HARBOR_VENV:-$ROOT/.venv-harbor}
harbor_py=""
for py in python3.13 python3.12 /root/.pyenv/versions/3.1[2-9]*/bin/python; do
  if command -v "$py" >/dev/null 2>&1 \
      && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    harbor_py=$py
    break
  fi
done
if [ -n "$harbor_py" ]; then
  [ -x "$HARBOR_VENV/bin/python" ] || "$harbor_py" -m venv "$HARBOR_VENV"
  hstamp="$HARBOR_VENV/.ray_sandbox-installed"
  if [ "$(cat "$hstamp" 2>/dev/null)" != "$want" ]; then
    log "installing ray_sandbox[harbor] into $HARBOR_VENV ($("$harbor_py" -V 2>&1))"
    "$HARBOR_VENV/bin/python" -m pip install -q --upgrade pip
    # harbor[modal]: Harbor's own modal environment, run against `serve --modal-port`
    "$HARBOR_VENV/bin/python" -m pip install -q -e "$ROOT[harbor,modal]" \
      "harbor[modal]>=0.26,<0.27"
    echo "$want" > "$hstamp"
  fi
else
  log "no Python >= 3.12: $HARBOR_VENV not built; tests/test_harbor.py will be skipped"
fi

# Each idle sandbox holds ~56 host tasks (runsc's threads, its ptrace stubs, a kernel thread for
# its disk; docs/scale.md, "Density") plus ~9 per guest process (ptrace), every one a PID out of
# the node's pid_max and one of kernel.threads-max: a stock pid_max of 32768 stops a node near
# 600 idle sandboxes and makes pids_limit="auto" small (docs/security.md). threads-max (RAM /
# 128 KiB, 192730 here: ~3,400 idle sandboxes, after memory's ~1,400) can bind first for busy ones:
# 1,000 sandboxes running ~15 guest processes each. Raise both to the kernel's pid maximum
# (never lower them); `ray-sandbox doctor` reports the ceiling and which limit sets it.
for knob in pid_max threads-max; do
  if [ "$(cat /proc/sys/kernel/$knob)" -lt 4194304 ]; then
    log "raising kernel.$knob to 4194304 (was $(cat /proc/sys/kernel/$knob))"
    sysctl -q -w kernel.$knob=4194304 || log "could not raise kernel.$knob (in a container?)"
  fi
done

log "ready: runsc $(runsc --version | awk '/runsc version/{print $3}'), python $("$VENV/bin/python" -V 2>&1)"
