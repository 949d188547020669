#!/usr/bin/env bash
# The Ray container's command on sandbox workers (annotation ray.io/overwrite-container-cmd):
# prepare cgroups for runsc, run KubeRay's generated `ray start --block`, and when Ray ends
# (pod deletion, scale-down, crash) delete this node's sandboxes before the container exits.
# As the container's PID 1 this bash also reaps the runsc processes orphaned to it.
set -uo pipefail

log() { printf '[entrypoint] %s\n' "$*" >&2; }

# Each idle sandbox holds ~56 host tasks (runsc's threads and ptrace stubs plus a kernel thread
# for its disk; docs/scale.md, "Density"), each a PID and one of kernel.threads-max. The kernel
# default pid_max of 32768 caps a node at ~600 sandboxes. threads-max (RAM / 128 KiB by
# default, ~900k on this pool's nodes) binds after memory for idle sandboxes, but each guest
# process adds ~9 tasks (ptrace): 1,000 sandboxes running ~100 processes each reach it. On the
# kernels GKE ships (< 6.14) pid_max is node-wide; from 6.14 it is per PID namespace, and this
# raises ours; threads-max is always node-wide. Never lowered. RAY_SANDBOX_PID_MAX overrides
# the target of both. `ray-sandbox doctor` (node-init.sh, and the line logged below) names the
# limit that binds.
want_pids=${RAY_SANDBOX_PID_MAX:-4194304}
raise_sysctl() {  # raise_sysctl NAME: /proc/sys/kernel/NAME to at least $want_pids
  local f=/proc/sys/kernel/$1
  if [ "$(cat "$f")" -lt "$want_pids" ]; then
    echo "$want_pids" > "$f" || log "cannot raise kernel.$1: set it on the node (docs/kuberay.md)"
  fi
}
raise_sysctl pid_max
raise_sysctl threads-max
COLUMNS=1000 ray-sandbox doctor 2>/dev/null | grep -E '^\S+ +ceiling ' >&2 || true

# cgroup v2 (GKE's default node image): the container sees its own cgroup as the root, and a
# cgroup with processes in it cannot hand controllers to children ("no internal processes").
# Move ourselves into a leaf and delegate memory/cpu/pids, so runsc can create one child cgroup
# per sandbox with limits that count against this pod. (cgroup v1 needs nothing here.)
if [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup/cgroup.subtree_control ]; then
  mkdir -p /sys/fs/cgroup/ray
  while read -r pid; do
    echo "$pid" > /sys/fs/cgroup/ray/cgroup.procs 2>/dev/null || true
  done < /sys/fs/cgroup/cgroup.procs
  for c in memory cpu pids; do
    echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null \
      || log "cannot delegate the $c controller: sandbox $c limits will not be enforced"
  done
fi

# A restarted container keeps the emptyDir home but not its processes (they died with the old
# PID namespace): clear that state now, while this namespace holds almost no PIDs that a
# stale record could name.
ray-sandbox gc || log "gc of the previous container's sandboxes failed"

: "${KUBERAY_GEN_RAY_START_CMD:?set by KubeRay when ray.io/overwrite-container-cmd is true}"
bash -c "$KUBERAY_GEN_RAY_START_CMD" &
ray_pid=$!
# SIGTERM from the kubelet goes to PID 1 (us): pass it on, then clean up below.
trap 'kill -TERM "$ray_pid" 2>/dev/null' TERM INT
wait "$ray_pid"
rc=$?
while kill -0 "$ray_pid" 2>/dev/null; do wait "$ray_pid"; rc=$?; done

# The host actor died with Ray; its sandboxes are now owned by a dead process. Delete them
# while we can still reach them: runsc cgroups, netns and nft tables in the pod's network
# namespace would otherwise outlive this container.
log "ray exited ($rc); deleting this node's sandboxes"
ray stop --force >/dev/null 2>&1 || true
ray-sandbox gc || log "gc failed; the next pod on this node retries (node-init.sh)"
exit "$rc"
