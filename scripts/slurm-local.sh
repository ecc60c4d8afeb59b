#!/usr/bin/env bash
# A real, throw-away SLURM 22.05 cluster on this one machine, for tests.
#
#   scripts/slurm-local.sh start            bring it up, write $ROOT/env.sh (and $ROOT/env), print READY
#   scripts/slurm-local.sh stop [--purge]   cancel jobs, stop daemons; --purge deletes $ROOT
#   scripts/slurm-local.sh status           daemons, sinfo, squeue (exit 0 iff running)
#   scripts/slurm-local.sh selftest         submit real jobs and check them (non-zero on failure)
#   scripts/slurm-local.sh release JOBID    start a requeued job now instead of after ~121 s
#
# Layout ("loopback mode"): munged on a private socket, optionally a private
# MariaDB + slurmdbd, one slurmctld, and one slurmd per node, all on this host.
# Each slurmd runs in its own UTS + mount namespace with hostname nodeI and a
# bind-mounted /etc/hosts that maps nodeJ -> 127.77.0.J, so inside a job
# `hostname` is the node's name and every node name resolves to an address
# that processes can bind and connect to (torchrun rendezvous needs both).
# Jobs inherit the namespaces, which is also how `stop` finds stray job
# processes.  The network namespace is shared, so each slurmd has its own Port.
#
# Every file lives under $SLURM_LOCAL_ROOT; nothing under /etc, /run or /var is
# touched (the node namespaces only bind-mount over /etc/hosts and /etc/slurm
# privately).  Needs root and the packages from scripts/install-system.sh.
#
# Knobs (environment):
#   SLURM_LOCAL_ROOT        state directory               (/tmp/dtlaunch-slurm)
#   SLURM_LOCAL_NODES       number of nodes               (2)
#   SLURM_LOCAL_CPUS        CPUs each node claims         (2; may exceed the real count)
#   SLURM_LOCAL_MEM_MB      RealMemory each node claims   (90% of MemTotal)
#   SLURM_LOCAL_ACCOUNTING  dbd | none                    (dbd)
#   SLURM_LOCAL_DB_PORT     private MariaDB port          (3307)
#   SLURM_LOCAL_CTLD_PORT   slurmctld port                (6817)
#   SLURM_LOCAL_DBD_PORT    slurmdbd port                 (6819)
#   SLURM_LOCAL_SLURMD_PORT_BASE  nodeI listens on BASE+I (6830)
#   SLURM_LOCAL_MIN_JOB_AGE seconds a finished job stays in slurmctld (60)
#   SLURM_LOCAL_CRED_EXPIRE job credential lifetime; also sets the requeue
#                           hold to this + 1 s (unset: Slurm's 120 -> 121 s hold)
#   SLURM_LOCAL_GPUS        GPUs each node claims as GRES gpu:local (0); counted
#                           only, no devices: for sbatch --test-only of GPU options
#
# Known-good settings and their reasons are recorded in docs/slurm-local.md;
# the comments below only repeat the non-obvious.
set -euo pipefail

ROOT=${SLURM_LOCAL_ROOT:-/tmp/dtlaunch-slurm}
ROOT=${ROOT%/}
NODES=${SLURM_LOCAL_NODES:-2}
CPUS=${SLURM_LOCAL_CPUS:-2}
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-dbd}
DB_PORT=${SLURM_LOCAL_DB_PORT:-3307}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
DBD_PORT=${SLURM_LOCAL_DBD_PORT:-6819}
SLURMD_PORT_BASE=${SLURM_LOCAL_SLURMD_PORT_BASE:-6830}
MIN_JOB_AGE=${SLURM_LOCAL_MIN_JOB_AGE:-60}
CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-}
GPUS=${SLURM_LOCAL_GPUS:-0}
GPU_TYPE=local
ADDR_PREFIX=127.77.0
CLUSTER=local
PARTITION=debug
# Written into $ROOT so that `stop --purge` never deletes a directory we did
# not create (SLURM_LOCAL_ROOT is user input).
MARKER=.dtlaunch-slurm-local

# Every Slurm command below, and every daemon we start, reads this config.
export SLURM_CONF=$ROOT/etc/slurm.conf
MUNGE_SOCKET=$ROOT/munge/munge.socket.2

T0=${EPOCHREALTIME/,/.}
log() { printf '[slurm-local %6.2fs] %s\n' "$(awk -v a="$T0" -v b="${EPOCHREALTIME/,/.}" 'BEGIN{print b-a}')" "$*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }

validate_knobs() {
    [[ $ROOT == /* && $ROOT != / ]] || die "SLURM_LOCAL_ROOT must be an absolute path other than / (got '$ROOT')"
    [[ $ROOT =~ ^[A-Za-z0-9_./+@%,:=-]+$ ]] \
        || die "SLURM_LOCAL_ROOT may only contain letters, digits and _./+@%,:=- (it goes into slurm.conf and env.sh)"
    # sun_path is 108 bytes; munged would fail with a much less clear message.
    (( ${#MUNGE_SOCKET} < 100 )) || die "SLURM_LOCAL_ROOT is too long for a unix socket path: $MUNGE_SOCKET"
    local v
    for v in NODES CPUS GPUS DB_PORT CTLD_PORT DBD_PORT SLURMD_PORT_BASE MIN_JOB_AGE; do
        [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer (got '${!v}')"
    done
    [[ -z $CRED_EXPIRE || $CRED_EXPIRE =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_CRED_EXPIRE must be an integer"
    (( NODES >= 1 && NODES <= 200 )) || die "SLURM_LOCAL_NODES must be 1..200"
    (( CPUS >= 1 )) || die "SLURM_LOCAL_CPUS must be >= 1"
    [[ $ACCOUNTING == dbd || $ACCOUNTING == none ]] || die "SLURM_LOCAL_ACCOUNTING must be dbd or none"
}

need_root_and_tools() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (the daemons run as root and slurmd needs namespaces)"
    local t tools=(munged mungekey slurmctld slurmd sinfo squeue sbatch scontrol scancel unshare nsenter flock)
    [[ $ACCOUNTING == dbd ]] && tools+=(slurmdbd sacctmgr sacct mariadbd mariadb-install-db mariadb mariadb-admin)
    for t in "${tools[@]}"; do
        command -v "$t" >/dev/null || die "'$t' not found; run scripts/install-system.sh first"
    done
}

nodelist() { if (( NODES == 1 )); then echo node1; else echo "node[1-$NODES]"; fi; }

# ---------------------------------------------------------------- processes

# True if PID is alive (not a zombie), is called NAME, and belongs to this
# cluster.  Checking the name and our root guards against PID reuse, and
# against touching another instance (system daemons, another SLURM_LOCAL_ROOT).
# Every daemon we start has $ROOT in its command line or SLURM_CONF in its
# environment.
pid_is_ours() {
    local pid=$1 name=$2 comm state
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$name" ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ $state != Z ]] || return 1
    tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$ROOT/" && return 0
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"
}

# Print the PID from pidfile $1 if that process is alive and called $2.
pidfile_pid() {
    local f=$1 name=$2 pid
    [[ -s $f ]] || return 1
    pid=$(tr -dc '0-9' <"$f")
    pid_is_ours "$pid" "$name" || return 1
    echo "$pid"
}

alive_or_zombie() { [[ -e /proc/$1 ]]; }
is_zombie() { [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) == Z ]]; }

# SIGTERM the given PIDs, wait up to $1 seconds, then SIGKILL what is left.
# Zombies count as gone: PID 1 on these machines reaps slowly.
SIGNALLED=()   # every PID we signalled, for the final wait in do_stop
term_wait_kill() {
    local timeout=$1; shift
    local pids=("$@") p left deadline
    (( ${#pids[@]} )) || return 0
    SIGNALLED+=("${pids[@]}")
    kill -TERM "${pids[@]}" 2>/dev/null || true
    deadline=$(( SECONDS + timeout ))
    while :; do
        left=()
        for p in "${pids[@]}"; do
            if alive_or_zombie "$p" && ! is_zombie "$p"; then left+=("$p"); fi
        done
        (( ${#left[@]} )) || return 0
        (( SECONDS < deadline )) || break
        sleep 0.1
    done
    log "SIGKILL after ${timeout}s: ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
}

# UTS namespaces of our nodes, as recorded by each node's launcher.  The host's
# own namespace is never returned, whatever the files say, so a bug or a
# failed unshare can never make `stop` kill every process on the machine.
our_uts_namespaces() {
    local host self f ns
    # /proc/1/ns may be unreadable (PID 1 is not always an ordinary process
    # here); our own namespace is the host's in any case.
    host=$(readlink /proc/1/ns/uts 2>/dev/null || true)
    self=$(readlink /proc/$$/ns/uts)
    for f in "$ROOT"/run/uts-node*; do
        [[ -s $f ]] || continue
        ns=$(<"$f")
        if [[ $ns == uts:* && $ns != "$host" && $ns != "$self" ]]; then echo "$ns"; fi
    done
}

# PIDs of all (non-zombie) processes living in one of our node namespaces:
# slurmd, slurmstepd and whatever jobs left behind.
pids_in_our_namespaces() {
    local -A want=()
    local ns d pid
    while read -r ns; do want[$ns]=1; done < <(our_uts_namespaces)
    (( ${#want[@]} )) || return 0
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        ns=$(readlink "$d/ns/uts" 2>/dev/null) || continue
        [[ -n ${want[$ns]:-} ]] || continue
        is_zombie "$pid" || echo "$pid"
    done
}

# ---------------------------------------------------------------- state

cluster_running() {
    # Settings of the running cluster, not of this shell's environment.
    [[ -f $ROOT/cluster.env ]] || return 1
    local nodes acct i
    nodes=$(sed -n 's/^NODES=//p' "$ROOT/cluster.env")
    acct=$(sed -n 's/^ACCOUNTING=//p' "$ROOT/cluster.env")
    pidfile_pid "$ROOT/run/munged.pid" munged >/dev/null || return 1
    pidfile_pid "$ROOT/run/slurmctld.pid" slurmctld >/dev/null || return 1
    if [[ $acct == dbd ]]; then
        pidfile_pid "$ROOT/run/mariadbd.pid" mariadbd >/dev/null || return 1
        pidfile_pid "$ROOT/run/slurmdbd.pid" slurmdbd >/dev/null || return 1
    fi
    for (( i = 1; i <= nodes; i++ )); do
        pidfile_pid "$ROOT/run/slurmd-node$i.pid" slurmd >/dev/null || return 1
    done
    timeout 10 scontrol ping >/dev/null 2>&1
}

# Refuse to delete a non-empty directory that this script did not create.
check_root_is_ours() {
    [[ -d $ROOT ]] || return 0
    [[ -e $ROOT/$MARKER ]] && return 0
    [[ -z $(ls -A "$ROOT") ]] && return 0
    die "$ROOT exists and was not created by slurm-local.sh (no $MARKER); refusing to touch it"
}

purge_root() {
    [[ -d $ROOT ]] || return 0
    check_root_is_ours
    # The MariaDB datadir can be busy for a moment after mariadbd exits.
    rm -rf "$ROOT" 2>/dev/null || { sleep 1; rm -rf "$ROOT"; }
}

# ---------------------------------------------------------------- stop

do_stop() {
    local purge=$1 pid ids deadline
    SIGNALLED=()
    if [[ ! -d $ROOT ]]; then
        echo "slurm-local: nothing at $ROOT"
        return 0
    fi
    check_root_is_ours

    # 1. Cancel jobs while slurmctld can still tell slurmd to kill them
    #    cleanly, so that no slurmstepd is left waiting on a dead controller.
    if pidfile_pid "$ROOT/run/slurmctld.pid" slurmctld >/dev/null; then
        ids=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [[ -n ${ids// /} ]]; then
            log "scancel $ids"
            # shellcheck disable=SC2086  # a list of job ids
            timeout 10 scancel $ids 2>/dev/null || true
            deadline=$(( SECONDS + 20 ))
            while (( SECONDS < deadline )) && [[ -n $(timeout 10 squeue -h -o %A 2>/dev/null || true) ]]; do
                sleep 0.2
            done
        fi
    fi

    # 2. Daemons in dependency order: the slurmds and slurmctld first (they
    #    report to slurmdbd), slurmdbd before its database, munged last since
    #    everything authenticates through it.
    local group=() f
    for f in "$ROOT"/run/slurmd-*.pid; do
        pid=$(pidfile_pid "$f" slurmd) && group+=("$pid")
    done
    pid=$(pidfile_pid "$ROOT/run/slurmctld.pid" slurmctld) && group+=("$pid")
    term_wait_kill 15 "${group[@]}"
    pid=$(pidfile_pid "$ROOT/run/slurmdbd.pid" slurmdbd) && term_wait_kill 15 "$pid"
    pid=$(pidfile_pid "$ROOT/run/mariadbd.pid" mariadbd) && term_wait_kill 15 "$pid"
    pid=$(pidfile_pid "$ROOT/run/munged.pid" munged) && term_wait_kill 15 "$pid"

    # 3. Whatever still lives in a node namespace (slurmstepd, job processes,
    #    a slurmd whose pid file is gone) has no one left to clean it up.
    local strays=()
    mapfile -t strays < <(pids_in_our_namespaces)
    if (( ${#strays[@]} )); then
        log "SIGKILL ${#strays[@]} leftover process(es) in node namespaces: ${strays[*]}"
        kill -KILL "${strays[@]}" 2>/dev/null || true
    fi

    SIGNALLED+=("${strays[@]}")

    # Give PID 1 a moment to reap, so that a `pgrep slurm` right after stop
    # does not see our zombies (best effort; they are harmless anyway).
    deadline=$(( SECONDS + 5 ))
    local p remaining
    while (( SECONDS < deadline )); do
        remaining=0
        for p in "${SIGNALLED[@]}"; do alive_or_zombie "$p" && remaining=1 && break; done
        (( remaining )) || break
        sleep 0.2
    done
    rm -f "$ROOT"/run/*.pid "$ROOT/cluster.env"

    if [[ $purge == 1 ]]; then
        purge_root
        log "stopped; removed $ROOT"
    else
        log "stopped (state kept in $ROOT)"
    fi
}

# ---------------------------------------------------------------- start

port_in_use() { [[ -n $(ss -Hltn "sport = :$1" 2>/dev/null) ]]; }

check_ports_free() {
    command -v ss >/dev/null || return 0
    local p i ports=("$CTLD_PORT")
    [[ $ACCOUNTING == dbd ]] && ports+=("$DBD_PORT" "$DB_PORT")
    for (( i = 1; i <= NODES; i++ )); do ports+=("$(( SLURMD_PORT_BASE + i ))"); done
    for p in "${ports[@]}"; do
        if port_in_use "$p"; then
            die "TCP port $p is already in use (another Slurm or MariaDB?); change SLURM_LOCAL_*_PORT"
        fi
    done
}

# Start a daemon detached from us: no inherited stdin/stdout (so
# `start | cat` returns when the script ends) and no inherited lock fd 9
# (a daemon holding it would block every later start/stop).
spawn() {
    local logfile=$1; shift
    setsid -f "$@" </dev/null >>"$logfile" 2>&1 9>&-
}

# Poll "$@" until it succeeds, at most $1 seconds.
wait_for() {
    local what=$1 timeout=$2; shift 2
    local deadline=$(( SECONDS + timeout ))
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || { echo "slurm-local: timed out after ${timeout}s waiting for $what" >&2; return 1; }
        sleep 0.1
    done
}

write_configs() {
    local host mem i
    host=$(hostname -s)
    mem=${SLURM_LOCAL_MEM_MB:-$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)}
    local authinfo="socket=$MUNGE_SOCKET"
    [[ -n $CRED_EXPIRE ]] && authinfo+=",cred_expire=$CRED_EXPIRE"

    {
        cat <<EOF
# Generated by scripts/slurm-local.sh; see docs/slurm-local.md in the dtlaunch repository.
ClusterName=$CLUSTER
# Must be this host's short name: slurmctld refuses to run on another host.
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT_BASE
AuthType=auth/munge
AuthInfo=$authinfo
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# linuxproc + task/none need no cgroup.conf and work on any cgroup layout
# that slurmd 22.05 accepts at all.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPUs/RealMemory below instead of the hardware, so that N nodes
# can each claim CPUs on a 2-core machine.
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
# The default batch_sched_delay=3 adds ~3 s to every job.
SchedulerParameters=batch_sched_delay=0,bf_interval=5
MpiDefault=none
InactiveLimit=0
KillWait=5
MinJobAge=$MIN_JOB_AGE
Waittime=0
JobRequeue=1
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
# Deliberately no CommunicationParameters=NoInAddrAny: with per-node 127.x
# addresses srun's replies then go to the wrong address and steps hang.
EOF
        if [[ $ACCOUNTING == dbd ]]; then
            cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# Clients of slurmdbd ignore AuthInfo and take the munge socket from here.
AccountingStoragePass=$MUNGE_SOCKET
EOF
        else
            echo "AccountingStorageType=accounting_storage/none"
        fi
        local gres=""
        if (( GPUS > 0 )); then
            # Counted GRES without device files: the scheduler and sbatch accept GPU
            # options (--gpus-per-node, --gres, --mem-per-gpu) though no GPU exists.
            echo "GresTypes=gpu"
            gres=" Gres=gpu:$GPU_TYPE:$GPUS"
        fi
        for (( i = 1; i <= NODES; i++ )); do
            echo "NodeName=node$i NodeAddr=$ADDR_PREFIX.$i Port=$(( SLURMD_PORT_BASE + i )) CPUs=$CPUS RealMemory=$mem$gres State=UNKNOWN"
        done
        echo "PartitionName=$PARTITION Nodes=$(nodelist) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    } >"$ROOT/etc/slurm.conf"
    if (( GPUS > 0 )); then
        # slurmd drops a GPU without device files and rejects a File that is not a
        # device: character devices with /dev/null's numbers (opening one is harmless).
        mkdir -p "$ROOT/dev"
        for (( i = 0; i < GPUS; i++ )); do
            [[ -c $ROOT/dev/gpu$i ]] || mknod "$ROOT/dev/gpu$i" c 1 3
        done
        printf 'AutoDetect=off\nName=gpu Type=%s File=%s/dev/gpu[0-%d]\n' "$GPU_TYPE" "$ROOT" $(( GPUS - 1 )) \
            >"$ROOT/etc/gres.conf"
    else
        rm -f "$ROOT/etc/gres.conf"
    fi

    # The hosts file every node sees: all node names, the controller's name,
    # and localhost.  127.0.0.0/8 is all on lo, so no address needs adding.
    {
        echo "127.0.0.1 localhost $host"
        echo "::1 localhost ip6-localhost ip6-loopback"
        for (( i = 1; i <= NODES; i++ )); do echo "$ADDR_PREFIX.$i node$i"; done
    } >"$ROOT/etc/hosts"

    if [[ $ACCOUNTING == dbd ]]; then
        # slurmdbd finds this next to $SLURM_CONF and insists on mode 600.
        install -m 600 /dev/null "$ROOT/etc/slurmdbd.conf"
        cat >"$ROOT/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmlocal
StorageLoc=slurm_acct_db
EOF
        # Durability is worthless for a throw-away test database; the flush
        # settings cut schema creation time, which is disk-bound.
        cat >"$ROOT/db/my.cnf" <<EOF
[mysqld]
datadir=$ROOT/db/data
# Private temp dir: concurrent clusters sharing /tmp clashed on MariaDB's temp tables.
tmpdir=$ROOT/db/tmp
socket=$ROOT/db/mysqld.sock
pid-file=$ROOT/run/mariadbd.pid
log-error=$ROOT/log/mariadbd.log
bind-address=127.0.0.1
port=$DB_PORT
user=root
skip-name-resolve
skip-log-bin
innodb_buffer_pool_size=256M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
innodb_flush_log_at_trx_commit=0
innodb_doublewrite=0
[client]
socket=$ROOT/db/mysqld.sock
user=root
EOF
    fi

    cat >"$ROOT/cluster.env" <<EOF
NODES=$NODES
CPUS=$CPUS
ACCOUNTING=$ACCOUNTING
GPUS=$GPUS
EOF
}

write_env_sh() {
    # Everything a client (shell, CI step, pytest fixture) needs.  Slurm's
    # commands are in /usr/bin, so PATH needs nothing.  Two forms: env.sh to
    # source, and env with plain KEY=VALUE lines (no quoting, no export) for
    # programs and $GITHUB_ENV-style consumers.
    local vars=(
        SLURM_CONF "$SLURM_CONF"
        SLURM_LOCAL_ROOT "$ROOT"
        SLURM_LOCAL_NODES "$NODES"
        SLURM_LOCAL_CPUS "$CPUS"
        SLURM_LOCAL_ACCOUNTING "$ACCOUNTING"
        SLURM_LOCAL_NODELIST "$(nodelist)"
        SLURM_LOCAL_PARTITION "$PARTITION"
        SLURM_LOCAL_MUNGE_SOCKET "$MUNGE_SOCKET"
    )
    local i k v
    {
        echo "# Generated by scripts/slurm-local.sh start; source it."
        for (( i = 0; i < ${#vars[@]}; i += 2 )); do
            k=${vars[i]} v=${vars[i+1]}
            # Single quotes keep node[1-2] from being globbed; no value we
            # write can contain a quote (validate_knobs rejects odd roots).
            printf "export %s='%s'\n" "$k" "$v"
        done
    } >"$ROOT/env.sh.tmp"
    for (( i = 0; i < ${#vars[@]}; i += 2 )); do
        printf '%s=%s\n' "${vars[i]}" "${vars[i+1]}"
    done >"$ROOT/env.tmp"
    mv "$ROOT/env.sh.tmp" "$ROOT/env.sh"
    mv "$ROOT/env.tmp" "$ROOT/env"
}

start_munged() {
    mungekey -c -k "$ROOT/munge/munge.key" -b 1024
    # munged itself daemonizes; it refuses a socket dir without o+x (hence 755).
    munged --socket="$MUNGE_SOCKET" --key-file="$ROOT/munge/munge.key" \
        --log-file="$ROOT/log/munged.log" --pid-file="$ROOT/run/munged.pid" \
        --seed-file="$ROOT/munge/munged.seed" </dev/null >>"$ROOT/log/munged.log" 2>&1 9>&-
    # shellcheck disable=SC2016  # expanded by the inner bash
    wait_for "munged" 10 bash -c 'munge -n -S "$1" | unmunge -S "$1"' _ "$MUNGE_SOCKET"
    log "munged up"
}

start_accounting() {
    local cnf=$ROOT/db/my.cnf
    mariadb-install-db --defaults-file="$cnf" --user=root --skip-test-db \
        --auth-root-authentication-method=socket >"$ROOT/log/mariadb-install-db.log" 2>&1 9>&- \
        || { tail -20 "$ROOT/log/mariadb-install-db.log" >&2; die "mariadb-install-db failed"; }
    log "mariadb datadir initialised"
    spawn "$ROOT/log/mariadbd.out" mariadbd --defaults-file="$cnf"
    wait_for "mariadbd" 60 mariadb-admin --defaults-file="$cnf" ping
    mariadb --defaults-file="$cnf" <<'EOF'
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmlocal';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
    log "mariadbd up (127.0.0.1:$DB_PORT)"
    slurmdbd </dev/null >>"$ROOT/log/slurmdbd.out" 2>&1 9>&-
    wait_for "slurmdbd" 60 timeout 10 sacctmgr -n show cluster
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
    log "slurmdbd up, cluster '$CLUSTER' registered"
}

start_slurmd() {
    local i=$1 name=node$1
    mkdir -p "$ROOT/spool/$name"
    rm -f "$ROOT/run/uts-$name"
    # A private UTS + mount namespace per node: hostname nodeI, our hosts
    # file, and our config dir as /etc/slurm so jobs submitted with
    # --export=NONE (no SLURM_CONF) still find the cluster.  nsenter/unshare
    # keep /sys as it is; `ip netns exec` would remount it and slurmd then
    # dies on the missing cgroup fs.  The namespace id is recorded first so
    # that `stop` can find everything that ever ran on this node.
    # shellcheck disable=SC2016  # expanded by the inner bash
    unshare --uts --mount --propagation private bash -c '
        set -e
        hostname "$1"
        readlink /proc/$$/ns/uts >"$2"
        mount --bind "$3/etc/hosts" /etc/hosts
        if [ -d /etc/slurm ]; then mount --bind "$3/etc" /etc/slurm; fi
        exec slurmd -f "$3/etc/slurm.conf" -N "$1"
    ' _ "$name" "$ROOT/run/uts-$name" "$ROOT" </dev/null >>"$ROOT/log/slurmd-$name.out" 2>&1 9>&- \
        || { tail -20 "$ROOT/log/slurmd-$name.out" "$ROOT/log/slurmd-$name.log" >&2 2>/dev/null; die "slurmd $name failed to start"; }
}

all_nodes_idle() {
    local states
    states=$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<<"$states") -eq $NODES ]]
}

on_start_failure() {
    local rc=$?
    trap - EXIT
    if (( rc != 0 )); then
        echo "slurm-local: start failed (rc=$rc); last log lines:" >&2
        local f
        for f in "$ROOT"/log/*.log "$ROOT"/log/*.out; do
            [[ -s $f ]] || continue
            echo "== $f" >&2
            tail -5 "$f" >&2
        done
        echo "slurm-local: stopping what was started (state kept in $ROOT for inspection)" >&2
        do_stop 0 >&2 || true
    fi
    exit "$rc"
}

do_start() {
    validate_knobs
    need_root_and_tools

    if cluster_running; then
        local running
        running=$(paste -sd' ' "$ROOT/cluster.env")
        echo "slurm-local: already running at $ROOT ($running)"
        [[ $running == "NODES=$NODES CPUS=$CPUS ACCOUNTING=$ACCOUNTING GPUS=$GPUS" ]] \
            || echo "slurm-local: note: the running cluster differs from the requested settings; stop it first to change them" >&2
        [[ -f $ROOT/env.sh ]] || write_env_sh
        echo READY
        return 0
    fi
    if [[ -d $ROOT ]]; then
        check_root_is_ours
        if [[ -n $(ls -A "$ROOT") ]]; then
            log "stale state in $ROOT; cleaning it"
            do_stop 1
        fi
    fi
    check_ports_free

    trap on_start_failure EXIT
    mkdir -p "$ROOT"
    touch "$ROOT/$MARKER"
    mkdir -p "$ROOT"/{etc,log,run,state,spool,munge}
    [[ $ACCOUNTING == dbd ]] && mkdir -p "$ROOT/db/tmp"
    # munged checks that everyone can traverse to its socket; a umask-077
    # parent (mktemp -d) would otherwise break it.
    chmod 755 "$ROOT" "$ROOT/munge"

    start_munged
    write_configs
    log "configs written"
    [[ $ACCOUNTING == dbd ]] && start_accounting

    slurmctld -i -f "$SLURM_CONF" </dev/null >>"$ROOT/log/slurmctld.out" 2>&1 9>&-
    wait_for "slurmctld" 30 timeout 5 scontrol ping
    log "slurmctld up"
    local i
    for (( i = 1; i <= NODES; i++ )); do start_slurmd "$i"; done
    wait_for "all $NODES nodes idle" 60 all_nodes_idle
    log "$NODES slurmd up; all nodes idle"
    write_env_sh
    trap - EXIT
    log "READY mode=loopback nodes=$NODES cpus=$CPUS accounting=$ACCOUNTING env=$ROOT/env.sh"
    echo READY
}

# ---------------------------------------------------------------- status

do_status() {
    if [[ ! -d $ROOT ]]; then
        echo "slurm-local: not running (no $ROOT)"
        return 1
    fi
    local f name pid
    for f in "$ROOT"/run/*.pid; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        if pid=$(pidfile_pid "$f" "${name%%-*}"); then
            echo "$name: running (pid $pid)"
        else
            echo "$name: NOT running"
        fi
    done
    if cluster_running; then
        echo "slurm-local: running at $ROOT ($(paste -sd' ' "$ROOT/cluster.env"))"
        sinfo -N -o '%N %T %c %m %P' || true
        squeue || true
        return 0
    fi
    echo "slurm-local: not running (stale state in $ROOT; start cleans it)"
    return 1
}

# ---------------------------------------------------------------- release

# After a requeue slurmctld holds the job for cred_expire + 1 s (121 s by
# default, Reason=BeginTime).  StartTime=now lifts the hold, but if that
# happens within the requeue's second or so, slurmd still remembers the old
# run as killed and refuses the launch ("Job N already killed, do not launch
# batch job"), and the job ends FAILED.  So wait until the old run has
# finished completing and >= 3 s have passed since the requeue (SubmitTime is
# reset to that moment once the job is pending again) before releasing.
do_release() {
    local id=${1:-}
    [[ $id =~ ^[0-9]+$ && $# -eq 1 ]] || die "usage: slurm-local.sh release JOBID"
    local info='' state='' submit restarts wait deadline=$(( SECONDS + 60 ))
    while :; do
        info=$(scontrol -o show job "$id") || die "no such job $id"
        state=$(grep -o 'JobState=[A-Z_]*' <<<"$info" | cut -d= -f2)
        # COMPLETING / REQUEUE* / RESIZING: the previous run is still ending.
        [[ $state == PENDING || $state == RUNNING || $state == COMPLETED || $state == FAILED \
            || $state == CANCELLED || $state == TIMEOUT ]] && break
        (( SECONDS < deadline )) || break
        sleep 0.2
    done
    if [[ $state != PENDING ]]; then
        echo "slurm-local: job $id is $state, not PENDING; nothing to release" >&2
        return 1
    fi
    restarts=$(grep -o 'Restarts=[0-9]*' <<<"$info" | cut -d= -f2)
    submit=$(grep -o 'SubmitTime=[0-9T:-]*' <<<"$info" | cut -d= -f2)
    if [[ ${restarts:-0} -gt 0 && -n $submit ]]; then
        wait=$(( $(date -d "$submit" +%s) + 3 - $(date +%s) ))
        if (( wait > 0 )); then
            echo "slurm-local: job $id was requeued at ${submit#*T}; waiting ${wait}s before releasing"
            sleep "$wait"
        fi
    fi
    scontrol update JobId="$id" StartTime=now
    echo "slurm-local: released job $id"
}

# ---------------------------------------------------------------- selftest

ST_FAILS=0
st_pass() { echo "PASS $*"; }
st_fail() { echo "FAIL $*"; ST_FAILS=$(( ST_FAILS + 1 )); }

# Wait until job $1 has left squeue (finished), at most $2 seconds.
st_wait_gone() {
    local id=$1 timeout=$2 deadline=$(( SECONDS + $2 ))
    while [[ -n $(squeue -h -j "$id" -t all -o '%T' 2>/dev/null | grep -vE '^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED)$' || true) ]]; do
        (( SECONDS < deadline )) || { st_fail "job $id still in squeue after ${timeout}s"; return 1; }
        sleep 0.2
    done
}

# sacct lags slurmctld a little; poll for the final state.
st_sacct_state() {
    local id=$1 want=$2 got='' deadline=$(( SECONDS + 15 ))
    while (( SECONDS < deadline )); do
        got=$(sacct -n -X -P -o State -j "$id" 2>/dev/null | head -n1 | awk '{print $1}')
        [[ $got == "$want" ]] && break
        sleep 0.5
    done
    if [[ $got == "$want" ]]; then st_pass "sacct job $id $got"; else st_fail "sacct job $id: want $want, got '${got}'"; fi
}

do_selftest() {
    cluster_running || die "cluster not running at $ROOT; run: scripts/slurm-local.sh start"
    # Settings of the running cluster decide what to expect.
    NODES=$(sed -n 's/^NODES=//p' "$ROOT/cluster.env")
    ACCOUNTING=$(sed -n 's/^ACCOUNTING=//p' "$ROOT/cluster.env")
    local dir t_start
    t_start=$SECONDS
    mkdir -p "$ROOT/selftest"
    dir=$(mktemp -d "$ROOT/selftest/run.XXXXXX")
    chmod 755 "$dir"

    cat >"$dir/one.sh" <<'EOF'
#!/bin/bash
echo "one host=$(hostname) node=$SLURMD_NODENAME job=$SLURM_JOB_ID"
EOF
    cat >"$dir/two.sh" <<'EOF'
#!/bin/bash
srun bash -c 'echo "task=$SLURM_PROCID host=$(hostname) node=$SLURMD_NODENAME"'
EOF
    # --export=NONE: no PATH and no SLURM_CONF; srun must find /etc/slurm.
    cat >"$dir/noexport.sh" <<'EOF'
#!/bin/bash
/usr/bin/srun /bin/hostname
EOF
    # What torchrun's c10d rendezvous does: the first node listens on its own
    # name, the others connect to that name.  The port is an ephemeral one
    # passed through the shared output dir, so that two clusters on one host
    # (or a busy port) cannot make this test flaky.
    cat >"$dir/tcp.sh" <<'EOF'
#!/bin/bash
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export PORT_FILE=$PWD/tcp.port.$SLURM_JOB_ID
srun python3 -c '
import os, socket, time
addr, port_file = os.environ["MASTER_ADDR"], os.environ["PORT_FILE"]
me = socket.gethostname()
if os.environ["SLURM_PROCID"] == "0":
    s = socket.socket()
    s.bind((addr, 0)); s.listen(1); s.settimeout(30)
    port = s.getsockname()[1]
    with open(port_file + ".tmp", "w") as f: f.write(str(port))
    os.rename(port_file + ".tmp", port_file)
    c, peer = s.accept()
    print(f"server on {me} bound {addr}={socket.gethostbyname(addr)}:{port} got {c.recv(100).decode()!r}", flush=True)
    c.sendall(b"ack"); c.close()
else:
    deadline = time.time() + 30
    while True:
        try:
            port = int(open(port_file).read())
            c = socket.create_connection((addr, port), timeout=5); break
        except (OSError, ValueError):
            if time.time() > deadline: raise
            time.sleep(0.1)
    c.sendall(f"hello from {me}".encode())
    print(f"client on {me} connected to {addr}:{port} reply {c.recv(100).decode()!r}", flush=True)
'
EOF
    # Requeue: the second run must see SLURM_RESTART_COUNT=1 and, with
    # --open-mode=append, both runs end up in one output file.
    cat >"$dir/requeue.sh" <<'EOF'
#!/bin/bash
echo "run restart=${SLURM_RESTART_COUNT:-0} host=$(hostname)"
sleep 60
EOF

    local j_one j_two j_noexp j_tcp j_rq
    j_rq=$(sbatch --parsable -J st-requeue -N1 -n1 --requeue --open-mode=append -o "$dir/requeue.out" "$dir/requeue.sh")
    j_one=$(sbatch --parsable -J st-one -N1 -n1 -o "$dir/one.out" "$dir/one.sh")
    j_noexp=$(sbatch --parsable -J st-noexport -N1 -n1 --export=NONE -o "$dir/noexport.out" "$dir/noexport.sh")
    # The multi-node jobs are pinned to node1,node2 so that the expected
    # output does not depend on SLURM_LOCAL_NODES or on placement.
    if (( NODES >= 2 )); then
        j_two=$(sbatch --parsable -J st-two -N2 -w node1,node2 --ntasks-per-node=1 -o "$dir/two.out" "$dir/two.sh")
        j_tcp=$(sbatch --parsable -J st-tcp -N2 -w node1,node2 --ntasks-per-node=1 -D "$dir" -o "$dir/tcp.out" "$dir/tcp.sh")
    fi
    echo "selftest: jobs one=$j_one noexport=$j_noexp two=${j_two:-skipped} tcp=${j_tcp:-skipped} requeue=$j_rq (output in $dir)"

    # --- requeue + release, interleaved with the others finishing
    local deadline=$(( SECONDS + 60 ))
    until grep -q 'restart=0' "$dir/requeue.out" 2>/dev/null; do
        (( SECONDS < deadline )) || break
        sleep 0.2
    done
    if grep -q 'restart=0' "$dir/requeue.out" 2>/dev/null; then
        scontrol requeue "$j_rq"
        # No sleep here on purpose: release itself must wait out the
        # requeue's first seconds (see do_release).
        do_release "$j_rq" >/dev/null || st_fail "requeue: release $j_rq failed"
        deadline=$(( SECONDS + 30 ))
        until grep -q 'restart=1' "$dir/requeue.out" 2>/dev/null; do
            (( SECONDS < deadline )) || break
            sleep 0.2
        done
        if grep -q 'restart=1' "$dir/requeue.out"; then
            st_pass "requeue: job $j_rq restarted with SLURM_RESTART_COUNT=1 after release"
        else
            st_fail "requeue: job $j_rq did not restart ($(squeue -h -j "$j_rq" -o '%T %r' 2>&1))"
        fi
    else
        st_fail "requeue: job $j_rq never started"
    fi
    scancel "$j_rq" 2>/dev/null || true

    # --- the plain jobs
    local id out
    for id in "$j_one" "$j_noexp" ${j_two:+"$j_two"} ${j_tcp:+"$j_tcp"}; do
        st_wait_gone "$id" 60 || true
    done

    out=$(cat "$dir/one.out" 2>/dev/null || true)
    if [[ $out =~ host=(node[0-9]+)\ node=(node[0-9]+) && ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]]; then
        st_pass "one-node job: $out"
    else
        st_fail "one-node job output: '$out'"
    fi
    out=$(cat "$dir/noexport.out" 2>/dev/null || true)
    if [[ $out =~ ^node[0-9]+$ ]]; then
        st_pass "--export=NONE job: srun found the config, ran on $out"
    else
        st_fail "--export=NONE job output: '$out'"
    fi
    if (( NODES >= 2 )); then
        local hosts
        hosts=$(grep -o 'host=node[0-9]* node=node[0-9]*' "$dir/two.out" 2>/dev/null \
            | awk '{split($1,h,"="); split($2,n,"="); if (h[2]==n[2]) print h[2]}' | sort -u | tr '\n' ' ')
        if [[ $hosts == "node1 node2 " ]]; then
            st_pass "2-node srun job: hostnames $hosts"
        else
            st_fail "2-node srun job: want 'node1 node2', got '$hosts' ($(tr '\n' '|' <"$dir/two.out" 2>/dev/null))"
        fi
        if grep -q "reply 'ack'" "$dir/tcp.out" 2>/dev/null && grep -q "server on node1 bound node1=$ADDR_PREFIX.1" "$dir/tcp.out"; then
            st_pass "2-node TCP rendezvous: $(tr '\n' '|' <"$dir/tcp.out")"
        else
            st_fail "2-node TCP rendezvous output: '$(tr '\n' '|' <"$dir/tcp.out" 2>/dev/null)'"
        fi
    fi
    if [[ $ACCOUNTING == dbd ]]; then
        for id in "$j_one" "$j_noexp" ${j_two:+"$j_two"} ${j_tcp:+"$j_tcp"}; do
            st_sacct_state "$id" COMPLETED
        done
    else
        # jobcomp/filetxt still records finished jobs without slurmdbd.
        if [[ $(sacct -c -n -P -o State -j "$j_one" 2>/dev/null | head -n1) == COMPLETED ]]; then
            st_pass "sacct --completion job $j_one COMPLETED"
        else
            st_fail "sacct --completion job $j_one not COMPLETED"
        fi
    fi
    st_wait_gone "$j_rq" 30 || true

    if (( ST_FAILS == 0 )); then
        echo "selftest: ALL PASSED in $(( SECONDS - t_start ))s"
        rm -rf "$dir"
        return 0
    fi
    echo "selftest: $ST_FAILS check(s) FAILED; outputs kept in $dir, logs in $ROOT/log" >&2
    return 1
}

# ---------------------------------------------------------------- main

usage() {
    sed -n '2,9s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

main() {
    local cmd=${1:-}
    [[ -n $cmd ]] || usage
    shift
    case $cmd in
        start|stop)
            # One start/stop at a time (parallel test workers may all call
            # start).  The lock lives beside $ROOT because --purge deletes
            # $ROOT itself.  Daemons are started with fd 9 closed.
            validate_knobs
            mkdir -p "$(dirname "$ROOT")"
            exec 9>"$ROOT.lock"
            flock -w 120 9 || die "another slurm-local.sh start/stop holds $ROOT.lock"
            if [[ $cmd == start ]]; then
                [[ $# -eq 0 ]] || usage
                do_start
            else
                case ${1:-} in
                    "") do_stop 0 ;;
                    --purge) do_stop 1 ;;
                    *) usage ;;
                esac
            fi
            ;;
        status) do_status ;;
        selftest) do_selftest ;;
        release) do_release "$@" ;;
        -h|--help|help) usage ;;
        *) usage ;;
    esac
}

main "$@"
