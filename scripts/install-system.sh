#!/usr/bin/env bash
# Install the system packages the test suite needs, from Debian's apt
# repositories: SLURM, munge, slurmdbd + MariaDB (scripts/slurm-local.sh), an
# sshd (the SSH submission tests), iproute2 and util-linux (the simulated
# SkyPilot nodes' namespaces), shellcheck (the rendered scripts' lint), strace
# (storage read errors injected into real runs).
#
# Idempotent and quick: packages that are already installed are skipped, and
# `apt-get update` only runs when something is actually missing.  Nothing is
# started: the machines have no systemd, and a postinst that tries to start a
# daemon would either fail (breaking dpkg) or leave a system-wide munged /
# mariadbd / slurmd running that would collide with the private instances
# slurm-local.sh starts.  A temporary policy-rc.d returning 101 ("action
# forbidden") makes invoke-rc.d skip every start during this run.
#
# Usage: scripts/install-system.sh         (as root, or with sudo; `make test` runs it)
# Env:   INSTALL_SLURM_DBD=0  skip slurmdbd + mariadb-server (accounting=none only)
set -euo pipefail

# Two groups, installed separately on purpose: slurmdbd and mariadb-server
# pull in a long tail of recommends (mail servers, perl extras, ...) that we
# do not want, while slurm-wlm is the tested meta-package and is installed
# with its recommends, as in the notes.
BASE_PKGS=(slurm-wlm munge openssh-server pdsh numactl iproute2 util-linux shellcheck strace)
DBD_PKGS=(slurmdbd mariadb-server)


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
    echo "install-system.sh: all packages already installed"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install-system.sh: missing ${need_base[*]} ${need_dbd[*]}; run as root (apt-get install)" >&2
    exit 1
fi

# policy-rc.d: ours for the duration of the install, whatever was there
# before (an existing one might allow starts); the previous state is restored
# on any exit, including a failed apt-get, so the host is not left with
# services permanently forbidden or a foreign policy lost.
POLICY=/usr/sbin/policy-rc.d
BACKUP=$POLICY.install-system-backup
had_policy=0
restore_policy() {
    rm -f "$POLICY"
    if [[ $had_policy == 1 ]]; then mv -f "$BACKUP" "$POLICY"; fi
}
if [[ -e $POLICY ]]; then
    had_policy=1
    cp -p "$POLICY" "$BACKUP"
fi
trap restore_policy EXIT
printf '#!/bin/sh\n# temporary, from dtlaunch scripts/install-system.sh\nexit 101\n' >"$POLICY.tmp"
chmod 755 "$POLICY.tmp"
mv -f "$POLICY.tmp" "$POLICY"

daemon_pids() { pgrep -x 'slurmctld|slurmd|slurmdbd|munged|mariadbd|mysqld' || true; }
mapfile -t before < <(daemon_pids)

t0=$SECONDS
apt-get update -q
if [[ ${#need_base[@]} -gt 0 ]]; then
    echo "install-system.sh: installing ${need_base[*]}"
    apt-get install "${APT_OPTS[@]}" "${need_base[@]}"
fi
if [[ ${#need_dbd[@]} -gt 0 ]]; then
    echo "install-system.sh: installing ${need_dbd[*]} (no recommends)"
    apt-get install "${APT_OPTS[@]}" --no-install-recommends "${need_dbd[@]}"
fi

# A postinst may still have managed to start something despite policy-rc.d
# (some call the daemon directly).  Our private instances need the default
# ports and sockets free, so report it loudly rather than kill something we
# did not start.  Only daemons that appeared during this install count:
# private clusters from slurm-local.sh may legitimately be running already.
mapfile -t after < <(daemon_pids)
for pid in "${after[@]}"; do
    if [[ " ${before[*]} " != *" $pid "* ]]; then
        echo "install-system.sh: warning: the install started $(ps -o comm= -p "$pid" || echo '?') (pid $pid)" >&2
    fi
done
echo "install-system.sh: done in $((SECONDS - t0))s"
