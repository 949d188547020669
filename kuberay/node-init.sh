#!/usr/bin/env bash
# Runs once per sandbox worker pod, before Ray starts (an initContainer of the same image):
# prepares the node for sandboxes and warms the node's image cache, so the first sandbox on a
# new node does not pay for a pull. Idempotent: a restarted pod on the same node finds the cache
# in the hostPath volume and only re-resolves the tags.
#
# Environment:
#   RAY_SANDBOX_HOME          this pod's sandbox state (an emptyDir), default /var/lib/ray_sandbox
#   RAY_SANDBOX_IMAGES        the node's image cache (a hostPath, shared by the node's pods)
#   RAY_SANDBOX_WARM_IMAGES   space-separated references to pull, e.g. a registry copy of
#                             ray-sandbox/python (docs/kuberay.md, "Images")
#   RAY_SANDBOX_BUILD_PYTHON  1 = also build ray-sandbox/python here with mmdebstrap (needs a
#                             Debian mirror from the pod, ~1 min); default 0
set -euo pipefail

log() { printf '[node-init] %s\n' "$*" >&2; }

home=${RAY_SANDBOX_HOME:-/var/lib/ray_sandbox}
images=${RAY_SANDBOX_IMAGES:-$home/images}

# Sandbox roots are kernel overlay mounts whose upper layer lives in the home and whose lower
# layer is the cached image; overlayfs cannot be an upper layer, so both must be volumes
# (emptyDir/hostPath on the node's disk), never the container's own overlay rootfs.
for d in "$home" "$images"; do
  mkdir -p "$d"
  if [ "$(stat -f -c %T "$d")" = overlayfs ]; then
    log "$d is on overlayfs: mount an emptyDir or hostPath volume there"
    exit 1
  fi
done

# Stale pins in the shared cache from a previous pod on this node (its sandboxes died with
# its PID namespace), so the cache can evict what nobody uses.
ray-sandbox gc

# The busybox image is built from the image's own busybox-static: seconds, no network.
ray-sandbox image build busybox >/dev/null
if [ "${RAY_SANDBOX_BUILD_PYTHON:-0}" = 1 ]; then
  ray-sandbox image build python >/dev/null
fi
for ref in ${RAY_SANDBOX_WARM_IMAGES:-}; do
  log "pulling $ref"
  ray-sandbox image pull "$ref" >/dev/null
done
ray-sandbox image ls >&2

# What this node enforces and what it does not (cgroup version, runsc features), for the logs.
ray-sandbox doctor >&2 || log "doctor reported problems (see above)"
