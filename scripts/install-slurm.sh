#!/usr/bin/env bash
# Install what scripts/slurm-local.sh (and the other cluster-ish tests) need,
# from Debian's apt repositories.
#
# Idempotent and quick: packages that are already installed are skipped, and
# `apt-get update` only runs when something is actually missing.  Nothing is
# started: the machines have no systemd, and a postinst that tries to start a
# daemon would either fail (breaking dpkg) or leave a system-wide munged /
# mariadbd / slurmd running that would collide with the private instances
# slurm-local.sh starts.  A temporary policy-rc.d returning 101 ("action
# forbidden") makes invoke-rc.d skip every start during this run.
#
# Usage: scripts/install-slurm.sh          (as root, or with sudo)
# Env:   INSTALL_SLURM_DBD=0  skip slurmdbd + mariadb-server (accounting=none only)
set -euo pipefail

# Two groups, installed separately on purpose: slurmdbd and mariadb-server
# pull in a long tail of recommends (mail servers, perl extras, ...) that we
# do not want, while slurm-wlm is the tested meta-package and is installed
# with its recommends, as in the notes.
BASE_PKGS=(slurm-wlm munge openssh-server pdsh numactl iproute2)
DBD_PKGS=(slurmdbd mariadb-server)

if [[ $(id -u) -ne 0 ]]; then
    echo "install-slurm.sh: must run as root (apt-get install)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Never stop to ask about changed conffiles: keep what is there.
APT_OPTS=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# Echo the packages from "$@" that are not fully installed.
missing() {
    local p status
    for p in "$@"; do
        status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
        [[ $status == installed ]] || printf '%s\n' "$p"
    done
}

mapfile -t need_base < <(missing "${BASE_PKGS[@]}")
need_dbd=()
if [[ ${INSTALL_SLURM_DBD:-1} != 0 ]]; then
    mapfile -t need_dbd < <(missing "${DBD_PKGS[@]}")
fi

if [[ ${#need_base[@]} -eq 0 && ${#need_dbd[@]} -eq 0 ]]; then
    echo "install-slurm.sh: all packages already installed"
    exit 0
fi

# policy-rc.d: install ours only if none exists, and restore the previous state
# on any exit (including a failed apt-get), so the host is not left with
# services permanently forbidden.
POLICY=/usr/sbin/policy-rc.d
created_policy=0
cleanup() {
    if [[ $created_policy == 1 ]]; then rm -f "$POLICY"; fi
}
trap cleanup EXIT
if [[ ! -e $POLICY ]]; then
    printf '#!/bin/sh\n# temporary, from dtlaunch scripts/install-slurm.sh\nexit 101\n' >"$POLICY"
    chmod 755 "$POLICY"
    created_policy=1
fi

t0=$SECONDS
apt-get update -q
if [[ ${#need_base[@]} -gt 0 ]]; then
    echo "install-slurm.sh: installing ${need_base[*]}"
    apt-get install "${APT_OPTS[@]}" "${need_base[@]}"
fi
if [[ ${#need_dbd[@]} -gt 0 ]]; then
    echo "install-slurm.sh: installing ${need_dbd[*]} (no recommends)"
    apt-get install "${APT_OPTS[@]}" --no-install-recommends "${need_dbd[@]}"
fi

# A postinst may still have managed to start something despite policy-rc.d
# (some call the daemon directly).  Our private instances need the default
# ports and sockets free, so report it loudly rather than kill things we did
# not start ourselves.
for d in slurmctld slurmd slurmdbd munged mariadbd; do
    if pgrep -x "$d" >/dev/null; then
        echo "install-slurm.sh: warning: a system '$d' is running (pid $(pgrep -x "$d" | tr '\n' ' '))" >&2
    fi
done
echo "install-slurm.sh: done in $((SECONDS - t0))s"
