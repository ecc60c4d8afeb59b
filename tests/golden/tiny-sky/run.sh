# One subshell around the whole run: SkyPilot appends its own lines after this script (with MOUNT_CACHED
# storage, the wait until rclone has uploaded every checkpoint file), and an `exit` at the top level would end
# the shell before them. Inside the subshell every `exit` ends only it; its code is what SkyPilot reads next.
(
set -uo pipefail
# A final exit code (launcher/jobenv.py's outcome policy: a bad recipe, a diverged loss) would only repeat itself,
# but a managed job recovers on every code it does not know: it is written, with this task's id, to checkpoint
# storage, where the next launch of the task reads it before anything else and ends at once with it.
FINAL_MARKER=""
mark_final() {
  case "$1" in
    2) if [ -n "$FINAL_MARKER" ] && mkdir -p "${FINAL_MARKER%/*}"; then echo "$1 ${SKYPILOT_TASK_ID:-}" > "$FINAL_MARKER"; fi ;;
    45) if [ -n "$FINAL_MARKER" ] && mkdir -p "${FINAL_MARKER%/*}"; then echo "$1 ${SKYPILOT_TASK_ID:-}" > "$FINAL_MARKER"; fi ;;
    46) if [ -n "$FINAL_MARKER" ] && mkdir -p "${FINAL_MARKER%/*}"; then echo "$1 ${SKYPILOT_TASK_ID:-}" > "$FINAL_MARKER"; fi ;;
  esac
}
fail() { local rc=$1; shift; echo "dtlaunch: error: $*" >&2; mark_final "$rc"; exit "$rc"; }
JOB_DIR="$PWD"
# This launch's attempt, one name on every node (their records meet in checkpoint storage): SkyPilot's job id
# on the cluster and the cluster's addresses, which a relaunch changes (a new job on the same cluster, new
# nodes), and the attempts earlier launches recorded there (new nodes may reuse an old address and job id 1).
sky_attempt() {
  local ips seen
  ips="$(printf '%s' "${SKYPILOT_NODE_IPS:-}" | cksum | cut -d' ' -f1)"
  seen="$(LC_ALL=C ls "$DTLAUNCH_CHECKPOINT_DIR/status" 2>/dev/null | cksum | cut -d' ' -f1)"
  echo "sky-${SKYPILOT_INTERNAL_JOB_ID:-0}-$ips-$seen"
}
# ---- identity: SKYPILOT_TASK_ID is stable across managed-job recoveries, so a recovered job resumes its
# own checkpoints; export DTLAUNCH_RUN_ID (or set run_id in the recipe) to resume an earlier run.
DEFAULT_RUN_ID="$SKYPILOT_TASK_ID"
export DTLAUNCH_RUN_ID="${DTLAUNCH_RUN_ID:-$DEFAULT_RUN_ID}"
# This allocation's start, for the goodput ledger (launcher/jobenv.py: ALLOCATION_START)
DTLAUNCH_ALLOCATION_START="$(date +%s.%N)"
export DTLAUNCH_ALLOCATION_START
export DTLAUNCH_RUN_DIR="${DTLAUNCH_RUN_DIR:-$JOB_DIR/runs/$DTLAUNCH_RUN_ID}"
export DTLAUNCH_PLAN="$JOB_DIR/plan.json"
export DTLAUNCH_CHECKPOINT_DIR="$DTLAUNCH_RUN_DIR/checkpoints"
DTLAUNCH_ATTEMPT="$(sky_attempt)"
export DTLAUNCH_ATTEMPT
export DTLAUNCH_STATUS="$DTLAUNCH_RUN_DIR/status/$DTLAUNCH_ATTEMPT"
# A collective timeout dumps the flight recorder here (per attempt), not into a node's /tmp.
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$DTLAUNCH_STATUS/nccl_trace_rank_"
# The VMs were this task's from their setup on, not from this run's start (a restart, a second run)
if [ -s "$HOME"/.dtlaunch-allocation-start ]; then
  read -r DTLAUNCH_ALLOCATION_START < "$HOME"/.dtlaunch-allocation-start || true
fi
FINAL_MARKER="$DTLAUNCH_CHECKPOINT_DIR"/.dtlaunch-final
if [ -f "$FINAL_MARKER" ]; then
  read -r FINAL_CODE FINAL_TASK < "$FINAL_MARKER" || true
  if [ -n "${FINAL_CODE:-}" ] && [ "${FINAL_TASK:-}" = "${SKYPILOT_TASK_ID:-}" ]; then
    echo "dtlaunch: this task already ended with exit code $FINAL_CODE, which is never retried ($FINAL_MARKER): not training again" >&2
    exit "$FINAL_CODE"
  fi
  rm -f "$FINAL_MARKER"  # another task's: a new submission of the run starts afresh
fi
# ---- rendezvous: the head node's address, derived explicitly (no silent localhost fallback)
MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"
if [ -z "$MASTER_ADDR" ]; then
  echo "dtlaunch: SKYPILOT_NODE_IPS is empty: no head-node address for the rendezvous" >&2
  exit 44
fi
export MASTER_ADDR
# This node's own address, as the other nodes reach it (its hostname may resolve to 127.0.1.1).
NODE_ADDR="$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")"
export DTLAUNCH_NODE_ADDR="$NODE_ADDR"
mkdir -p "$DTLAUNCH_STATUS"
PORT="${DTLAUNCH_PORT:-29500}"

# The interpreter of this machine's environment, resolved here (after any setup lines) and never taken
# from the machine that rendered a cluster job; then one quick check that it can run this plan, so a
# broken environment fails once with exit 2 instead of crashing every rank and every restart, and
# a node whose GPUs are missing or broken with 44 (the node, not the plan: exclude it).
PYTHON="${DTLAUNCH_PYTHON:-$(command -v python3 || command -v python || true)}"
if [ -z "$PYTHON" ]; then
  fail 2 "no python3 on PATH;" 'the task'"'"'s setup installs dtlaunch from the wheel next to task.yaml; check the setup log (sky logs)'
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
  fail 2 "$CHECK_RUNNER cannot run this plan (exit $CHECK_RC, see above);" 'the task'"'"'s setup installs dtlaunch from the wheel next to task.yaml; check the setup log (sky logs)'
fi

# SkyPilot stops a job by signalling its processes; torchrun (or DeepSpeed's launcher) passes the signal to
# the workers, which checkpoint; this shell only waits, to report the workers' own exit code.
trap ':' TERM USR2
IS_HOST=0
if [ "$SKYPILOT_NODE_RANK" = 0 ]; then IS_HOST=1; fi  # the head hosts the rendezvous store, whatever its hostname says
export DTLAUNCH_NODE_RANK="$SKYPILOT_NODE_RANK"  # node ranks in SkyPilot's order, not by address
# Each rank's lines start with [NODE rank R]; its output is also kept in RUN_DIR/logs/attempt-N/NODE/.
NODE_NAME="${SLURMD_NODENAME:-$(hostname)}"
export PET_TEE=3 PET_LOG_DIR="$DTLAUNCH_RUN_DIR/logs/attempt-$DTLAUNCH_ATTEMPT/$NODE_NAME"
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[$NODE_NAME rank \${rank}] "
"$PYTHON" -m launcher.runtime.elastic "--check-plan=$DTLAUNCH_PLAN" "--nnodes=$SKYPILOT_NUM_NODES" --nproc-per-node=2 --rdzv-backend=c10d "--rdzv-endpoint=$MASTER_ADDR:$PORT" "--rdzv-id=$DTLAUNCH_RUN_ID" "--rdzv-conf=join_timeout=120,is_host=$IS_HOST" "--local-addr=$NODE_ADDR" --max-restarts=2 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2 --shutdown-timeout=31 -m launcher.runtime.train --plan "$DTLAUNCH_PLAN" --run-dir "$DTLAUNCH_RUN_DIR" &
LAUNCHER=$!
rc=0
while :; do
  wait "$LAUNCHER"; rc=$?
  kill -0 "$LAUNCHER" 2>/dev/null || break  # wait returns early when a trapped signal arrives
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
  fail 2 "$CHECK_RUNNER cannot run this plan (exit $CHECK_RC, see above);" 'the task'"'"'s setup installs dtlaunch from the wheel next to task.yaml; check the setup log (sky logs)'
fi
CODE="$(dtl_outcome "$rc")"
peer_lost_only() {  # every rank of this node that ended failed only because a peer's connection closed
  local f code cause n=0
  for f in "$DTLAUNCH_STATUS"/rank-*.code; do
    [ -f "$f" ] || continue
    read -r code _ _ cause _ < "$f" || return 1
    if [ "$code" != 1 ] || [ "$cause" != peer ]; then return 1; fi
    n=$((n + 1))
  done
  [ "$n" -gt 0 ]
}
if [ "$CODE" = 1 ] && peer_lost_only; then
  echo "dtlaunch: this node's ranks lost a peer: waiting 15 s for the node that failed to end first"
  sleep 15
fi
mark_final "$CODE"
exit "$CODE"
)
