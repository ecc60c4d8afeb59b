"""Checks before the first training step, so a broken node fails in seconds with a clear message
instead of hours later: everyone reached rendezvous, every device computes at its rate (a GEMM burn-in),
the fabric delivers the bandwidth it should (the world's all-reduce, and link by link around the nodes' ring
and each node's), the checkpoint directory has room, and (on GPU nodes) /dev/shm is big enough for NCCL.

All ranks take part; rank 0 decides and reports, and the verdict is shared so that every rank
exits with PREFLIGHT together.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

# NCCL needs shared memory for intra-node transport; Docker's 64 MB default breaks it.
MIN_SHM_BYTES = 1 << 30
# Below this much free space where a node keeps the run directory (logs, records), preflight names the node.
MIN_NODE_FREE_BYTES = 1 << 30


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    storage: bool = False  # a failure is the checkpoint storage's (no room): StorageError, not PREFLIGHT
    figures: dict = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)  # each rank's node (jobenv.node_name), by rank
    culprits: list[str] = field(default_factory=list)  # the nodes a failure is localised to (the rest are fine)


def bus_bandwidth_gbps(nbytes: int, seconds: float, world: int) -> float:
    """Ring all-reduce bus bandwidth (NCCL-tests convention): algbw * 2(n-1)/n, in GB/s."""
    if seconds <= 0 or world < 2:
        return 0.0
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def measure_allreduce(device: torch.device, nbytes: int, iters: int = 5, group=None) -> float:
    """Seconds per all-reduce of `nbytes` over `group` (after a warm-up), the max over the world's ranks."""
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _node_facts() -> dict:
    """What one rank of each node reports of its node: its check before training (the record the check
    left in this attempt's status directory: the summary, or the failure) and the free space where the run
    directory is (its logs and records)."""
    import shutil

    from .. import jobenv
    from .status import check_records

    facts: dict = {}
    status = os.environ.get(jobenv.STATUS)
    records = check_records(Path(status), jobenv.node_name()) if status else []  # one file per node, or none
    if records:
        facts["check"] = {"code": records[0].get("code"), "summary": records[0].get("message")}
    try:
        facts["free_bytes"] = shutil.disk_usage(os.environ.get(jobenv.RUN_DIR) or ".").free
    except OSError:
        pass
    return facts


def check_rendezvous(world, rep: Report) -> None:
    """Every rank is here (ranks 0..n-1 exactly), and which hosts they are on; each node's own facts
    (_node_facts) from its first local rank: in the record by node, a nearly full disk named."""
    n = world.world_size
    from ..jobenv import node_name

    me = {
        "rank": world.rank,
        "host": socket.gethostname(),
        "node": node_name(),
        "local_rank": world.proc.local_rank,
        "pid": os.getpid(),
        "facts": _node_facts() if world.proc.local_rank == 0 else None,
    }
    everyone: list = [me]
    if world.distributed:
        everyone = [None] * n
        dist.all_gather_object(everyone, me)
    hosts = sorted({e["host"] for e in everyone})
    ranks = sorted(e["rank"] for e in everyone)
    if ranks != list(range(n)):
        rep.failures.append(f"rendezvous: expected ranks 0..{n - 1}, got {ranks}")
    more = " ..." if len(hosts) > 8 else ""
    rep.lines.append(f"rendezvous: {n} ranks on {len(hosts)} host(s): {', '.join(hosts[:8])}{more}")
    rep.figures["hosts"] = len(hosts)
    rep.nodes = [str(e.get("node") or e["host"]) for e in sorted(everyone, key=lambda e: e["rank"])]
    rep.figures["nodes"] = rep.nodes  # each rank's node: the key to every figure recorded by rank
    facts = {str(e.get("node") or e["host"]): e["facts"] for e in everyone if e.get("facts")}
    checks = {k: f["check"] for k, f in facts.items() if f.get("check")}
    if checks:
        rep.figures["node_checks"] = checks
    free = {k: f["free_bytes"] for k, f in facts.items() if isinstance(f.get("free_bytes"), int)}
    if free:
        rep.figures["node_free_bytes"] = free
    for k, b in sorted(free.items()):
        if b < MIN_NODE_FREE_BYTES:
            rep.lines.append(
                f"WARNING: node {k} has {b / 1e9:.2f} GB free where the run directory is: its logs and records "
                "may not fit"
            )


def allreduce_bytes(is_gpu: bool, world_size: int) -> int:
    """The all-reduce's size: large enough to reach the fabric's bus bandwidth (NCCL-tests plateau at >= 1 GB
    beyond a node: 256 MB under-reports multi-node rings and could fail a good fabric), small on CPU."""
    if not is_gpu:
        return 16 << 20
    return (1 << 30) if world_size > 8 else (256 << 20)


def node_groups(world_size: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ranks of each node, the ranks of each local rank across nodes), ranks placed node by node as torchrun
    and srun place them."""
    nodes = world_size // per_node
    intra = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    inter = [[n * per_node + local for n in range(nodes)] for local in range(per_node)]
    return intra, inter


def check_bandwidth(world, network, min_fraction: float, rep: Report) -> None:
    """All-reduce bus bandwidth. Inside one node it runs over NVLink/PCIe (or loopback), which says nothing of the
    network: measured and reported on its own. Across nodes, the world's all-reduce is held against the network
    profile (a fraction below the minimum fails)."""
    n = world.world_size
    if not world.distributed or n < 2:
        return
    per_node = max(1, world.proc.local_world_size)
    nodes = n // per_node if n % per_node == 0 else 1
    nbytes = allreduce_bytes(world.is_gpu, n)
    if nodes > 1 and per_node > 1:
        intra, _ = node_groups(n, per_node)
        mine, groups = dist.new_subgroups_by_enumeration(intra)
        try:
            secs = measure_allreduce(world.device, nbytes, group=mine)
        finally:
            for g in groups:
                dist.destroy_process_group(g)
        bw = bus_bandwidth_gbps(nbytes, secs, per_node)
        rep.figures.update(intra_node_gbps=round(bw, 3))
        rep.lines.append(
            f"all-reduce {nbytes >> 20} MB inside each node ({per_node} ranks): {secs * 1e3:.1f} ms, "
            f"bus bandwidth {bw:.2f} GB/s (the slowest node)"
        )
    secs = measure_allreduce(world.device, nbytes)
    bw = bus_bandwidth_gbps(nbytes, secs, n)
    if nodes == 1:
        rep.figures.update(intra_node_gbps=round(bw, 3))
        rep.lines.append(
            f"all-reduce {nbytes >> 20} MB on one node ({n} ranks): {secs * 1e3:.1f} ms, bus bandwidth "
            f"{bw:.2f} GB/s (inside a node; the network profile '{network.name}' applies across nodes)"
        )
        return
    expected = network.node_gbps
    frac = bw / expected if expected else 0.0
    rep.figures.update(allreduce_gbps=round(bw, 3), expected_gbps=expected, allreduce_fraction=round(frac, 3))
    msg = (
        f"all-reduce {nbytes >> 20} MB across {nodes} nodes ({n} ranks): {secs * 1e3:.1f} ms, bus bandwidth "
        f"{bw:.2f} GB/s = {frac:.0%} of the '{network.name}' profile's {expected:g} GB/s"
    )
    if min_fraction > 0 and frac < min_fraction:
        rep.failures.append(
            msg + f", below the required {min_fraction:.0%} (training.min_allreduce_fraction); "
            "check the fabric / NCCL settings"
        )
    else:
        rep.lines.append(msg)


LINK_BYTES_GPU, LINK_BYTES_CPU = 64 << 20, 4 << 20
LINK_ITERS = 5


def ring_rounds(members: int) -> list[list[tuple[int, int]]]:
    """The links of a ring of `members` (i <-> i+1, the last back to the first) in rounds of disjoint pairs, so
    that no member tests two links at once: the even links, the odd ones, and with an odd count the closing link
    on its own. A ring of two has one link."""
    if members < 2:
        return []
    links = [(i, (i + 1) % members) for i in range(members if members > 2 else 1)]
    even = [ln for k, ln in enumerate(links) if k % 2 == 0 and not (members % 2 and k == members - 1)]
    odd = [ln for k, ln in enumerate(links) if k % 2 == 1]
    last = [links[-1]] if members > 2 and members % 2 else []
    return [r for r in (even, odd, last) if r]


def _exchange_seconds(device: torch.device, peer: int, nbytes: int, delay: float) -> float:
    """Seconds per exchange of `nbytes` each way with the global rank `peer` (both send at once), after a
    warm-up. `delay`: the test-only slow-link fault's seconds per exchange."""
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def once() -> None:
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if delay:
            time.sleep(delay)

    once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(LINK_ITERS):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / LINK_ITERS


def _measure_rings(world, per_node: int, nbytes: int, delay: float) -> list[dict]:
    """Every rank's measured links, {"inter": [(rank, peer, seconds)], "intra": [...]}, gathered on every rank:
    the nodes' ring (local rank 0 of each node with the next node's), then each node's ring of local ranks
    (all nodes at once), in rounds of disjoint pairs with a barrier between them."""
    n = world.world_size
    node, local = divmod(world.rank, per_node)
    mine: dict[str, list] = {"inter": [], "intra": []}
    for kind, members, me, to_rank in (
        ("inter", n // per_node, node if local == 0 else None, lambda m: m * per_node),
        ("intra", per_node, local, lambda m: node * per_node + m),
    ):
        for pairs in ring_rounds(members):
            for a, b in pairs:
                if me in (a, b):
                    secs = _exchange_seconds(world.device, to_rank(b if me == a else a), nbytes, delay)
                    if me == a:
                        mine[kind].append((world.rank, to_rank(b), secs))
            dist.barrier()
    everyone: list = [None] * n
    dist.all_gather_object(everyone, mine)
    return everyone


def check_links(world, network, min_fraction: float, rep: Report, delay: float = 0.0) -> None:
    """Pairwise bandwidth around two rings, so that a slow link is localised: the nodes' ring, held against the
    network profile when training.min_allreduce_fraction is set (a node whose links on both sides are slow is
    the culprit; a single slow link names its two nodes), and inside each node the ring of its local ranks
    (reported: NVLink/PCIe have no profile here). Each link's figure goes to the preflight record (`links`,
    `intra_links`)."""
    n = world.world_size
    per_node = max(1, world.proc.local_world_size)
    if not world.distributed or n < 2 or n % per_node:
        return
    nbytes = LINK_BYTES_GPU if world.is_gpu else LINK_BYTES_CPU
    everyone = _measure_rings(world, per_node, nbytes, delay)
    names = rep.nodes or [str(r // per_node) for r in range(n)]

    def links(kind: str) -> list[dict]:
        out = [
            {"ranks": [a, b], "nodes": [names[a], names[b]], "gbps": round(nbytes / s / 1e9, 3) if s > 0 else 0.0}
            for e in everyone
            for a, b, s in e[kind]
        ]
        return sorted(out, key=lambda ln: ln["ranks"])

    intra = links("intra")
    if intra:
        rep.figures["intra_links"] = intra
        worst = min(intra, key=lambda ln: ln["gbps"])
        rep.lines.append(
            f"pairwise inside nodes: {len(intra)} link(s) of {nbytes >> 20} MB each way, the slowest "
            f"{worst['gbps']:.2f} GB/s (ranks {worst['ranks'][0]} <-> {worst['ranks'][1]} on {worst['nodes'][0]})"
        )
    _judge_node_links(links("inter"), network, min_fraction, rep)


def _judge_node_links(inter: list[dict], network, min_fraction: float, rep: Report) -> None:
    if not inter:
        return
    rep.figures["links"] = inter
    expected = network.node_gbps
    worst = min(inter, key=lambda ln: ln["gbps"])
    rep.lines.append(
        f"pairwise between nodes: {len(inter)} link(s), the slowest {worst['gbps']:.2f} GB/s "
        f"({worst['nodes'][0]} <-> {worst['nodes'][1]})"
        + (f"; the '{network.name}' profile expects {expected:g} GB/s" if expected else "")
    )
    slow = [ln for ln in inter if min_fraction > 0 and expected and ln["gbps"] < min_fraction * expected]
    if not slow:
        return
    count: dict[str, int] = {}
    for ln in slow:
        for name in set(ln["nodes"]):
            count[name] = count.get(name, 0) + 1
    # a node with both of its ring links slow is the culprit; a lone slow link can be either end's
    both = sorted(k for k, c in count.items() if c >= 2)
    rep.culprits = both or sorted(count)
    for ln in slow:
        rep.failures.append(
            f"link {ln['nodes'][0]} <-> {ln['nodes'][1]} (ranks {ln['ranks'][0]} <-> {ln['ranks'][1]}): "
            f"{ln['gbps']:.2f} GB/s, below {min_fraction:.0%} of the '{network.name}' profile's {expected:g} GB/s "
            "(training.min_allreduce_fraction)"
        )
    rep.failures.append(
        f"the slow link(s) point at node(s) {', '.join(rep.culprits)}"
        + (" (both of its ring links are slow)" if both else " (one link: either end)")
    )


GEMM_MIN_FRACTION = 0.25  # of the table's dense peak: a GPU this far below it is broken or throttled, not just busy
GEMM_ITERS = 10


def _gemm_seconds(device: torch.device, is_gpu: bool, delay: float) -> tuple[float, float]:
    """(seconds per matmul, its FLOPs): bf16 (or fp16) 8192^3 on a GPU (large enough to reach the tensor cores' rate),
    a small fp32 one on a CPU; after a warm-up. `delay`: the test-only slow fault's seconds per matmul."""
    # the peak table's figure is bf16's, or fp16's on GPUs without bf16 (V100, T4), where bf16 is emulated
    half = torch.bfloat16 if is_gpu and torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    n, dtype = (8192, half) if is_gpu else (256, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if is_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(GEMM_ITERS):
        a @ b
        if delay:
            time.sleep(delay)
    if is_gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / GEMM_ITERS, 2.0 * n**3


def check_gemm(world, rep: Report, delay: float = 0.0) -> None:
    """A short GEMM burn-in on every rank's device: its rate against the device's dense peak
    (catalog.DEVICE_PEAK_TFLOPS; below GEMM_MIN_FRACTION fails, naming the node) and against the other ranks'
    (a robust outlier is named: a throttled GPU before it becomes a straggler). Every rank's TFLOPS go to the
    preflight record (`gemm_tflops`, by rank)."""
    from .metrics import device_peak_tflops
    from .stragglers import outliers

    secs, flops = _gemm_seconds(world.device, world.is_gpu, delay)
    mine = (secs, flops / secs / 1e12 if secs > 0 else 0.0)
    everyone: list = [mine]
    if world.distributed:
        everyone = [None] * world.world_size
        dist.all_gather_object(everyone, mine)
    rates = [round(r, 4) for _, r in everyone]
    rep.figures["gemm_tflops"] = rates
    peak, name = device_peak_tflops(world.is_gpu)
    names = rep.nodes or ["?"] * len(rates)
    what = "8192^3 on the tensor cores" if world.is_gpu else "fp32 256^3 (CPU)"
    line = f"GEMM burn-in ({what}): {min(rates):.3g}-{max(rates):.3g} TFLOPS over {len(rates)} rank(s)"
    rep.lines.append(
        line + (f", {min(rates) / peak:.0%}-{max(rates) / peak:.0%} of the {name}'s {peak:g}" if peak else "")
    )
    for r in outliers([s for s, _ in everyone]):
        rep.lines.append(
            f"WARNING: GEMM burn-in: rank {r} on {names[r]} runs {rates[r]:.3g} TFLOPS, against the median rank's "
            f"{sorted(rates)[len(rates) // 2]:.3g}: a throttled or faulty device (watch it for stragglers)"
        )
    if peak and world.is_gpu and rates[world.rank] < GEMM_MIN_FRACTION * peak:
        rep.failures.append(
            f"GEMM burn-in on {names[world.rank]} (local rank {world.proc.local_rank}): {rates[world.rank]:.0f} "
            f"TFLOPS, {rates[world.rank] / peak:.0%} of the {name}'s dense peak {peak:g}, below "
            f"{GEMM_MIN_FRACTION:.0%}: the GPU is throttled or failing"
        )
        rep.culprits = sorted({*rep.culprits, names[world.rank]})


def check_checkpoint_space(world, checkpoint_dir: Path, checkpoint_bytes: float, keep: int, rep: Report) -> None:
    """Room for the checkpoints (rank 0 looks; on shared storage that is everyone's view). Uncommitted
    directories of dead attempts count as room: start-up removes them (once rank 0 holds the run's lock), and a
    run that failed on a full disk must not then fail here on its own leftovers."""
    if world.rank != 0:
        return
    from .checkpoint.disk import free_bytes, partial_dirs, tree_bytes

    leftovers = sum(tree_bytes(p) for p in partial_dirs(checkpoint_dir))
    free = free_bytes(checkpoint_dir) + leftovers
    rep.figures.update(checkpoint_free_bytes=free, checkpoint_bytes=int(checkpoint_bytes))
    need = checkpoint_bytes * (keep + 1)
    line = (
        f"checkpoint dir {checkpoint_dir}: {free / 1e9:.2f} GB free"
        + (f" (with {leftovers / 1e9:.2f} GB of uncommitted leftovers that start-up removes)" if leftovers else "")
        + f", one checkpoint ~{checkpoint_bytes / 1e9:.3f} GB"
    )
    if free < checkpoint_bytes:
        rep.failures.append(
            line + ": not enough room for a single checkpoint; free space there or point "
            "checkpoint.dir at larger storage"
        )
        rep.storage = True
    elif free < need:
        rep.lines.append(line + f" (WARNING: keep={keep} needs ~{need / 1e9:.2f} GB)")
    else:
        rep.lines.append(line)


def check_shm(world, rep: Report) -> None:
    """/dev/shm, which NCCL needs on GPU nodes (each rank looks at its own node's)."""
    shm = _shm_bytes()
    if shm is None:
        return
    rep.figures["shm_bytes"] = shm
    if world.is_gpu and shm < MIN_SHM_BYTES:
        rep.failures.append(
            f"/dev/shm is {shm / 2**20:.0f} MB; NCCL needs >= {MIN_SHM_BYTES >> 20} MB "
            f"(docker: --shm-size=16g or --ipc=host)"
        )
    else:
        rep.lines.append(f"/dev/shm: {shm / 2**30:.1f} GB" + ("" if world.is_gpu else " (CPU run: not needed)"))


def share_failures(world, rep: Report) -> None:
    """Every rank's local failures, merged, so that all ranks exit with PREFLIGHT together (and know the nodes a
    failure was localised to)."""
    if not world.distributed:
        return
    allf: list = [None] * world.world_size
    dist.all_gather_object(allf, (rep.failures, rep.storage, rep.culprits))
    merged = [f if r == 0 else f"rank {r}: {f}" for r, (fs, _, _) in enumerate(allf) for f in fs or []]
    rep.failures = list(dict.fromkeys(merged))
    rep.storage = any(st for _, st, _ in allf)
    rep.culprits = sorted({c for _, _, cs in allf for c in cs or []})


def run(
    *,
    world,
    network,
    checkpoint_dir: Path,
    checkpoint_bytes: float,
    keep: int,
    min_allreduce_fraction: float,
    link_delay: float = 0.0,
    gemm_delay: float = 0.0,
) -> Report:
    """Collective. Returns rank 0's report (other ranks get the shared failures). `link_delay`, `gemm_delay`: the
    test-only slow-link and slow faults' seconds per exchange and per matmul on this rank."""
    rep = Report()
    check_rendezvous(world, rep)
    check_gemm(world, rep, gemm_delay)
    check_bandwidth(world, network, min_allreduce_fraction, rep)
    check_links(world, network, min_allreduce_fraction, rep, link_delay)
    check_checkpoint_space(world, checkpoint_dir, checkpoint_bytes, keep, rep)
    check_shm(world, rep)
    share_failures(world, rep)
    return rep


def _shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize
