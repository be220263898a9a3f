#!/usr/bin/env bash
# Boot a real systemd as PID 1 of a systemd-nspawn container whose root is a throwaway
# overlay of this machine's own root. tests/support/real_systemd.py starts this script,
# owns its lifetime and cleans up after it; run by hand it needs root.
#
#   real_systemd_boot.sh MACHINE_NAME CGROUP_DIR[:CGROUP_DIR...] [NSPAWN_ARG...]
#
# Phase one joins the cgroup directories the caller created (one per mounted hierarchy),
# so that the container and everything it starts stays below them and the caller can kill
# and remove the lot afterwards. It then re-executes itself in a private mount namespace:
# every mount made below exists only there and disappears with the namespace's last
# process, so even a run killed half way leaves nothing mounted on the host.
#
# Phase two mounts one tmpfs over /run/systemd (nspawn keeps its runtime files there; on
# these machines the host's /run is on disk, and a leftover file there would confuse the
# next run), builds the overlay's upper layer inside it so that everything the container
# writes stays in memory, writes a few files into that layer that shape the boot, and
# execs systemd-nspawn. NSPAWN_ARG (e.g. --bind-ro=/work/main) go to nspawn as they are.
set -euo pipefail

if [ "${1:-}" != --in-namespace ]; then
  [ $# -ge 2 ] || { echo "usage: $0 MACHINE_NAME CGROUP_DIR[:CGROUP_DIR...] [NSPAWN_ARG...]" >&2; exit 2; }
  machine=$1
  IFS=: read -r -a cgroups <<<"$2"
  shift 2
  for cgroup in "${cgroups[@]}"; do
    echo $$ >"$cgroup/cgroup.procs"
  done
  exec unshare --mount --propagation private -- bash "$0" --in-namespace "$machine" "$@"
fi
machine=$2
shift 2

BASE=/run/systemd/vacancyd-harness
mkdir -p /run/systemd
mount -t tmpfs -o "mode=0755,size=${VACANCYD_HARNESS_TMPFS_SIZE:-4g}" vacancyd-harness /run/systemd
mkdir -p "$BASE/upper" "$BASE/work" "$BASE/root"
UP=$BASE/upper
UNITS=$UP/etc/systemd/system
mkdir -p "$UNITS" "$UP/etc/systemd/journald.conf.d" "$UP/etc/systemd/system.conf.d"

# A machine id of its own (journald and logind key their state on it) and a host name
# that says which machine a log line came from.
systemd-id128 new >"$UP/etc/machine-id"
echo "$machine" >"$UP/etc/hostname"

# The boot stops at a target of our own: the basic system, the system bus and logind.
# The default (graphical.target) would start whatever services this image has installed,
# which costs time and ties the container's behaviour to the host's package set.
cat >"$UNITS/vacancyd-harness.target" <<'EOF'
[Unit]
Description=vacancyd test harness: basic system, D-Bus and logind only
Requires=basic.target
Wants=dbus.socket dbus.service systemd-logind.service systemd-user-sessions.service
After=basic.target dbus.service systemd-logind.service systemd-user-sessions.service
AllowIsolate=yes
EOF
ln -sf vacancyd-harness.target "$UNITS/default.target"

# Timers would run the image's periodic jobs (apt, man-db, fstrim...) in the middle of a
# test, and the units the host's administrator enabled (sockets, gettys, databases) are
# the host's business: all of them are masked in the container.
mask() { ln -sf /dev/null "$UNITS/$1"; }
for unit in /lib/systemd/system/*.timer /etc/systemd/system/*.timer \
  /etc/systemd/system/*.target.wants/*; do
  [ -e "$unit" ] || [ -L "$unit" ] || continue
  name=${unit##*/}
  case $name in
    dbus.* | systemd-logind.* | *.target) ;;
    *) mask "$name" ;;
  esac
done
mask timers.target

# The journal stays in memory and small. A unit that will not stop delays power-off by
# 15 s at most rather than the default 90 s, which keeps teardown bounded.
cat >"$UP/etc/systemd/journald.conf.d/vacancyd-harness.conf" <<'EOF'
[Journal]
Storage=volatile
RuntimeMaxUse=32M
EOF
cat >"$UP/etc/systemd/system.conf.d/vacancyd-harness.conf" <<'EOF'
[Manager]
DefaultTimeoutStopSec=15s
EOF

mount -t overlay vacancyd-harness \
  -o "lowerdir=/,upperdir=$BASE/upper,workdir=$BASE/work" "$BASE/root"

# --register=no --keep-unit: no machined and no host manager is involved (this machine's
# PID 1 is not systemd). --private-network: the container has only its own loopback.
# --system-call-filter=bpf: nspawn's seccomp filter otherwise refuses bpf(), and systemd
# then silently stops enforcing DevicePolicy=/DeviceAllow= for the units inside.
# --kill-signal=SIGRTMIN+4: a SIGTERM to nspawn becomes a clean power-off of the container.
export SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1
exec systemd-nspawn -D "$BASE/root" --machine="$machine" --register=no --keep-unit \
  --private-network --link-journal=no --system-call-filter=bpf --console=pipe \
  --kill-signal=SIGRTMIN+4 "$@" -b
