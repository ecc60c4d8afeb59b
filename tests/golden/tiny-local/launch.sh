#!/usr/bin/env bash
# Rendered by dtlaunch for the local target. Run it: bash launch.sh
# Exit code: the workers' own (0 done, 42 preempted after a checkpoint, 43 hang, 2 bad plan, ...), not torchrun's generic 1.
# A signal to this script (TERM, INT, USR2) is passed to torchrun, which passes it to the workers: they
# checkpoint and exit 42.
set -uo pipefail
# Every ending records its exit code for `dtlaunch status`, this one too (a missing record reads LOST).
fail() {
  local rc=$1; shift
  echo "dtlaunch: error: $*" >&2
  if [ -d "${DTLAUNCH_STATUS:-}" ]; then echo "$rc" > "$DTLAUNCH_STATUS/exit_code"; fi
  exit "$rc"
}
# Stopped before torchrun starts (`dtlaunch down` in the job's first second): nothing has trained, so nothing is
# lost; record it as stopped, not as a vanished job. Then torchrun's agent does the same until its workers start
# (launcher.runtime.elastic), and passes the signal to them after.
stop_early() {
  echo "dtlaunch: stopped by SIG$1 before training began" >&2
  if [ -n "${DTLAUNCH_STATUS:-}" ]; then
    mkdir -p "$DTLAUNCH_STATUS" && echo 42 > "$DTLAUNCH_STATUS/exit_code"
  fi
  exit 42
}
trap 'stop_early TERM' TERM
trap 'stop_early INT' INT
trap 'stop_early USR2' USR2
trap 'stop_early HUP' HUP
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
export TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=60000
export TORCH_FR_BUFFER_SIZE=2000
export NCCL_DEBUG=WARN
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export OMP_NUM_THREADS=1
DEFAULT_RUN_ID=tiny
export DTLAUNCH_RUN_ID="${DTLAUNCH_RUN_ID:-$DEFAULT_RUN_ID}"
# This allocation's start, for the goodput ledger (launcher/jobenv.py: ALLOCATION_START)
DTLAUNCH_ALLOCATION_START="$(date +%s.%N)"
export DTLAUNCH_ALLOCATION_START
export DTLAUNCH_RUN_DIR="${DTLAUNCH_RUN_DIR:-$HERE}"
export DTLAUNCH_PLAN="$HERE/plan.json"
export DTLAUNCH_CHECKPOINT_DIR="$DTLAUNCH_RUN_DIR/checkpoints"
DTLAUNCH_ATTEMPT="${DTLAUNCH_ATTEMPT:-manual-$(date +%s)-$$}"
export DTLAUNCH_ATTEMPT
export DTLAUNCH_STATUS="$DTLAUNCH_RUN_DIR/status/$DTLAUNCH_ATTEMPT"
# A collective timeout dumps the flight recorder here (per attempt), not into a node's /tmp.
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$DTLAUNCH_STATUS/nccl_trace_rank_"
mkdir -p "$DTLAUNCH_STATUS"

# The interpreter of this machine's environment, resolved here (after any setup lines) and never taken
# from the machine that rendered a cluster job; then one quick check that it can run this plan, so a
# broken environment fails once with exit 2 instead of crashing every rank and every restart, and
# a node whose GPUs are missing or broken with 44 (the node, not the plan: exclude it).
DEFAULT_PYTHON=<python that rendered>
PYTHON="${DTLAUNCH_PYTHON:-$DEFAULT_PYTHON}"
if [ ! -x "$PYTHON" ]; then PYTHON="$(command -v python3 || command -v python || true)"; fi
if [ -z "$PYTHON" ]; then
  fail 2 "no python3 on PATH;" 'set DTLAUNCH_PYTHON to the python of an environment that has dtlaunch[train] (or activate it)'
fi
export PYTHON
# The plan is checked by the torchrun agent, before it joins the rendezvous and in the process (and the torch
# import) it has anyway. Here only what the agent cannot say for itself: that this environment has dtlaunch and
# torch at all (exit 2 with what to do), without importing torch.
CHECK_RC=0 CHECK_RUNNER="$PYTHON"
"$PYTHON" -m launcher.runtime.elastic --check-environment || CHECK_RC=$?
if [ "$CHECK_RC" -eq 44 ]; then
  fail 44 "a node cannot run the plan (see above): exclude it and resubmit"
elif [ "$CHECK_RC" -eq 2 ] || [ "$CHECK_RC" -eq 46 ]; then
  fail "$CHECK_RC" "the pre-start check failed: its message above says what and how to fix it"
elif [ "$CHECK_RC" -ne 0 ]; then
  fail 2 "$CHECK_RUNNER cannot run this plan (exit $CHECK_RC, see above);" 'set DTLAUNCH_PYTHON to the python of an environment that has dtlaunch[train] (or activate it)'
fi

# A free port, not 29500: another job on this machine may hold it.
PORT="${DTLAUNCH_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
# Each rank's lines start with [NODE rank R]; its output is also kept in RUN_DIR/logs/attempt-N/NODE/.
NODE_NAME="${SLURMD_NODENAME:-$(hostname)}"
export PET_TEE=3 PET_LOG_DIR="$DTLAUNCH_RUN_DIR/logs/attempt-$DTLAUNCH_ATTEMPT/$NODE_NAME"
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[$NODE_NAME rank \${rank}] "
# torchrun in a session of its own: a signal to this script reaches it once, through the trap below.
setsid "$PYTHON" -m launcher.runtime.elastic "--check-plan=$DTLAUNCH_PLAN" --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d "--rdzv-endpoint=127.0.0.1:$PORT" "--rdzv-id=$DTLAUNCH_RUN_ID" --rdzv-conf=join_timeout=120,is_host=1 --local-addr=127.0.0.1 --max-restarts=3 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2 --shutdown-timeout=31 -m launcher.runtime.train --plan "$DTLAUNCH_PLAN" --run-dir "$DTLAUNCH_RUN_DIR" &
TORCHRUN=$!
forward() { kill "-$1" "$TORCHRUN" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR2' USR2
trap 'forward TERM' HUP
rc=0
while :; do
  wait "$TORCHRUN"; rc=$?
  kill -0 "$TORCHRUN" 2>/dev/null || break  # wait returns early when a trapped signal arrives
done
# The exit code of this node's share of the job: the workers' own codes for this attempt, not torchrun's
# generic 1. The runtime writes "CODE STEP START_STEP CAUSE" to $DTLAUNCH_STATUS/rank-N.code as each rank ends
# (CAUSE "peer": the rank failed only because a peer's connection closed under it), and a node whose check before
# training failed the same to check-NODE.code (on shared status, every node's share then ends with its code).
# A rank killed after a collective timed out (NCCL's watchdog aborts it) writes no code, but leaves the
# flight recorder's dump (TORCH_NCCL_DEBUG_INFO_TEMP_FILE): a collective timed out, so this is a hang (43)
# even where other ranks then failed on the broken connection; but not over a rank's own error, which the
# others timed out waiting for (a hung gloo rank writes its dump too). A bad plan (2), a broken node (44), a
# diverged loss (45) and failing checkpoint storage (46) come first: restarting would not help.
dtl_outcome() {
  local rc=$1 f code cause worst="" peer="" own=""
  if [ "$rc" = 0 ]; then echo 0; return; fi
  for f in "$DTLAUNCH_STATUS"/rank-*.code "$DTLAUNCH_STATUS"/check-*.code; do
    [ -f "$f" ] || continue
    read -r code _ _ cause _ < "$f" || continue
    case "$code" in
      2|44|45|46) echo "$code"; return ;;
      1) if [ "$cause" = peer ]; then peer=1; else worst=1 own=1; fi ;;
      43) [ "$worst" = 1 ] || worst=43 ;;
      42) [ -n "$worst" ] || worst=42 ;;
    esac
  done
  # A rank that only lost a peer fails the job unless another rank's hang explains it.
  if [ -n "$peer" ] && [ "$worst" != 43 ]; then worst=1; fi
  for f in "$DTLAUNCH_STATUS"/nccl_trace_rank_*; do
    if [ -e "$f" ] && [ -z "$own" ]; then echo 43; return; fi
  done
  echo "${worst:-$rc}"
}
# The agent's check of the plan failed: its record says how, and no rank started.
CHECK_RC=0 CHECK_RUNNER="$PYTHON"
for f in "$DTLAUNCH_STATUS"/check-*.code; do
  if [ -f "$f" ]; then read -r CHECK_RC _ < "$f" || CHECK_RC=2; fi
done
case "$CHECK_RC" in ''|*[!0-9]*) CHECK_RC=2 ;; esac
if [ "$CHECK_RC" -eq 44 ]; then
  fail 44 "a node cannot run the plan (see above): exclude it and resubmit"
elif [ "$CHECK_RC" -eq 2 ] || [ "$CHECK_RC" -eq 46 ]; then
  fail "$CHECK_RC" "the pre-start check failed: its message above says what and how to fix it"
elif [ "$CHECK_RC" -ne 0 ]; then
  fail 2 "$CHECK_RUNNER cannot run this plan (exit $CHECK_RC, see above);" 'set DTLAUNCH_PYTHON to the python of an environment that has dtlaunch[train] (or activate it)'
fi
rc="$(dtl_outcome "$rc")"
echo "$rc" > "$DTLAUNCH_STATUS/exit_code"
exit "$rc"
