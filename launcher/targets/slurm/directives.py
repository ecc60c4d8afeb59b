"""The #SBATCH options of a job: the ones the plan decides, the ones targets.slurm fields write, and the
user's extra_sbatch entries, with the clashes between them. Apart from the job script's templates, so that
`validate` can check extra_sbatch against what the job script will say without loading the renderer.
"""

from __future__ import annotations

from ...plan import Plan
from ...recipe import Recipe

# Options dtlaunch derives from the plan: extra_sbatch must not contradict them.
PLAN_OPTIONS = (
    "--nodes",
    "-N",
    "--ntasks",
    "-n",
    "--ntasks-per-node",
    "--gpus-per-node",
    "--gpus",
    "-G",
    "--array",
    "-a",
    "--signal",
    "--requeue",
    "--no-requeue",
    "--output",
    "-o",
    "--open-mode",
    "--job-name",
    "-J",
)
# Options a targets.slurm field writes (the field that does), with sbatch's short spellings: an extra_sbatch
# entry naming one of these, while directives() already writes it, is a second value for the same thing.
FIELD_OPTIONS = {
    "--time": "time",
    "--mem": "mem",
    "--mem-per-gpu": "mem_per_gpu",
    "--cpus-per-task": "cpus_per_task",
    "--cpus-per-gpu": "cpus_per_gpu",
    "--gres": "gpu_request",
    "--partition": "partition",
    "--account": "account",
    "--qos": "qos",
    "--constraint": "constraint",
    "--exclusive": "exclusive",
    "--reservation": "reservation",
    "--nodelist": "nodelist",
    "--exclude": "exclude",
    "--dependency": "dependency",
    "--mail-type": "mail_type",
    "--mail-user": "mail_user",
}
SHORT_OPTIONS = {
    "-t": "--time",
    "-c": "--cpus-per-task",
    "-p": "--partition",
    "-A": "--account",
    "-q": "--qos",
    "-C": "--constraint",
    "-w": "--nodelist",
    "-x": "--exclude",
    "-d": "--dependency",
}
# sbatch refuses two of one group together (e.g. --mem with --mem-per-gpu), whichever wrote them.
EXCLUSIVE_GROUPS = (("--mem", "--mem-per-gpu", "--mem-per-cpu"), ("--cpus-per-task", "--cpus-per-gpu"))


def directives(recipe: Recipe, plan: Plan, array: str | None = None) -> list[tuple[str, object | None]]:
    """(option, value) pairs for the #SBATCH lines; the template quotes them for sbatch's own parser."""
    opts = _field_directives(recipe, plan, array)
    for extra in recipe.targets.slurm.extra_sbatch:
        extra = extra.strip()  # an sbatch option: the recipe loader refused anything else (syntax.parse_sbatch_option)
        name, sep, val = extra.partition("=")
        opts.append((name, val if sep else None))
    return opts


def option_name(entry: str) -> str:
    """The long option an extra_sbatch entry sets: `-w node1` and `--nodelist=node1` are the same option."""
    name = entry.strip().partition("=")[0].split()[0] if entry.strip() else ""
    return SHORT_OPTIONS.get(name, name)


def field_clashes(recipe: Recipe, plan: Plan) -> list[tuple[str, str, str]]:
    """(extra_sbatch entry, what dtlaunch already writes, the targets.slurm field that writes it) for every
    entry that would be a second value for an option a field sets, or that sbatch refuses next to one
    (--mem-per-gpu beside the --mem=0 an exclusive job gets). Plan options are the other rule's."""
    t = recipe.targets.slurm
    written = {o: v for o, v in _field_directives(recipe, plan)}
    out = []
    for entry in t.extra_sbatch:
        name = option_name(entry)
        if name in PLAN_OPTIONS:
            continue
        if name == "--gres":  # another generic resource is fine, unless the GPUs are already a --gres
            if "--gres" in written or "gpu" in entry.partition("=")[2]:
                out.append(
                    (entry, f"--gres={written['--gres']}" if "--gres" in written else "--gpus-per-node", "gpu_request")
                )
            continue
        for group in EXCLUSIVE_GROUPS:
            if name in group:
                hit = [o for o in group if o in written]
                if hit:
                    o = hit[0]
                    out.append((entry, o + ("" if written[o] is None else f"={written[o]}"), FIELD_OPTIONS[o]))
                break
        else:
            if name in written and name in FIELD_OPTIONS:
                v = written[name]
                out.append((entry, name + ("" if v is None else f"={v}"), FIELD_OPTIONS[name]))
    return out


def _node_resources(recipe: Recipe, plan: Plan) -> list[tuple[str, object | None]]:
    """GPUs, CPUs and memory per node, in the spelling the site's configuration asks for."""
    t = recipe.targets.slurm
    gpu = recipe.resources.device().is_gpu
    opts: list[tuple[str, object | None]] = []
    if gpu:
        count = f"{t.gpu_type}:{plan.gpus_per_node}" if t.gpu_type else plan.gpus_per_node
        if t.gpu_request == "gres":  # clusters without select/cons_tres know GPUs only as generic resources
            opts.append(("--gres", f"gpu:{count}"))
        else:
            opts.append(("--gpus-per-node", count))
    cpus = t.cpus_per_task or (None if gpu else plan.gpus_per_node)
    if cpus:
        opts.append(("--cpus-per-task", cpus))
    if t.cpus_per_gpu and gpu:  # validate refuses cpus_per_gpu on a CPU recipe (no GPU to count)
        opts.append(("--cpus-per-gpu", t.cpus_per_gpu))
    mem = t.mem
    if mem is None and t.mem_per_gpu is None and (t.exclusive or plan.layout.offload != "none"):
        # sbatch(1): an --exclusive job "is only allocated as much memory as it requested"; 0 asks for all of
        # the node's memory, which host-offloaded optimizer states need in any case. With mem_per_gpu the
        # request is per GPU instead (sbatch refuses --mem together with --mem-per-gpu).
        mem = "0"
    if mem is not None:
        opts.append(("--mem", mem))
    if t.mem_per_gpu is not None and gpu:
        opts.append(("--mem-per-gpu", t.mem_per_gpu))
    return opts


def _field_directives(recipe: Recipe, plan: Plan, array: str | None = None) -> list[tuple[str, object | None]]:
    t = recipe.targets.slurm
    opts: list[tuple[str, object | None]] = [
        ("--job-name", recipe.job_name),
        ("--nodes", plan.nodes),
        ("--ntasks-per-node", 1),  # one torchrun per node; it spawns one process per device
    ]
    opts += _node_resources(recipe, plan)
    opts.append(("--time", t.time))
    for key in ("partition", "account", "qos", "constraint", "reservation", "nodelist", "exclude", "dependency"):
        if getattr(t, key):
            opts.append((f"--{key}", getattr(t, key)))
    if t.mail_type:
        opts.append(("--mail-type", ",".join(t.mail_type)))
    if t.mail_user:
        opts.append(("--mail-user", t.mail_user))
    if array is not None:
        opts.append(("--array", array + (f"%{t.array_parallelism}" if t.array_parallelism else "")))
    opts += [
        ("--output", "%x-%j.out" if array is None else "%x-%A_%a.out"),  # relative: the submit directory
        ("--open-mode", "append"),  # a requeued attempt appends instead of wiping the first one's output
        ("--signal", f"B:USR2@{t.signal_seconds}"),  # B: the batch shell gets it and forwards it
        ("--requeue", None),
    ]
    if t.exclusive:
        opts.append(("--exclusive", None))
    return opts
