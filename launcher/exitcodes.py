"""Exit codes shared by the runtime (which exits with them) and the wrappers (which act on them).

SLURM scripts requeue on PREEMPTED, SkyPilot managed jobs recover on PREEMPTED and HANG
(`recover_on_exit_codes`), and torchrun restarts on anything non-zero.
"""
OK = 0
FAILED = 1
CONFIG = 2  # bad recipe, plan or flags: restarting will not help
PREEMPTED = 42  # a checkpoint was written after SIGUSR2/SIGTERM: requeue and resume
HANG = 43  # a collective timed out or ranks disagreed on the step: restart and resume
PREFLIGHT = 44  # the environment is broken (rendezvous, bandwidth, disk): fix the nodes first

RESTARTABLE = (PREEMPTED, HANG)
