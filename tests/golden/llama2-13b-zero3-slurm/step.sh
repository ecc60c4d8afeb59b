#!/usr/bin/env bash
# Rendered by dtlaunch: run by srun once per node (see job.sbatch). Not meant to be run by hand.
#
# slurmstepd delivers a step signal (the USR2 the batch script forwards, or SLURM's TERM) to every process
# of the step: torchrun handles it (--signals-to-handle), passes it to its workers and waits up to
# --shutdown-timeout for them to checkpoint and exit, without restarting them. This shell only waits.
set -uo pipefail
trap ':' USR2 TERM
IS_HOST=0
if [ "${SLURM_NODEID:-}" = 0 ]; then IS_HOST=1; fi  # node 0 hosts the rendezvous store, whatever its hostname says
export DTLAUNCH_NODE_RANK="${SLURM_NODEID:-}"  # node ranks in SLURM's (topology-aware) order, not by hostname
# Each rank's lines start with [NODE rank R]; its output is also kept in RUN_DIR/logs/attempt-N/NODE/.
NODE_NAME="${SLURMD_NODENAME:-$(hostname)}"
export PET_TEE=3 PET_LOG_DIR="$DTLAUNCH_RUN_DIR/logs/attempt-$DTLAUNCH_ATTEMPT/$NODE_NAME"
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[$NODE_NAME rank \${rank}] "
"$PYTHON" -m launcher.runtime.elastic "--check-plan=$DTLAUNCH_PLAN" "--nnodes=$SLURM_NNODES" --nproc-per-node=4 --rdzv-backend=c10d "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" "--rdzv-id=$SLURM_JOB_ID" "--rdzv-conf=join_timeout=900,is_host=$IS_HOST" "--local-addr=$SLURMD_NODENAME" --max-restarts=2 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2 --shutdown-timeout=316 -m launcher.runtime.train --plan "$DTLAUNCH_PLAN" --run-dir "$DTLAUNCH_RUN_DIR" &
TORCHRUN=$!
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
exit "$(dtl_outcome "$rc")"
