"""The recipe's whole world, every rank, on a fake process group: what `dtlaunch rehearse`'s world check asks of a
layout too large to start here as processes.

`check_mesh` builds the runtime's own DeviceMesh (`runtime.engines.mesh.build_mesh`) for the plan's world size and
checks every rank's place in it: each rank exactly once, the dimensions of the plan's degrees, each rank's
coordinates those the rest of the runtime computes (`Layout.coords`: data shards, checkpoint files, the pipeline
stage), and every tensor-parallel group inside one node (its collectives run on every layer, over NVLink only
when the node holds the group). The step itself (its collectives and memory at full size) is the trace's
(`launcher.trace.trace`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MeshCheck:
    shape: dict[str, int]  # mesh dimension -> size
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        return " x ".join(f"{k} {v}" for k, v in self.shape.items())


def check_mesh(layout, world_size: int, gpus_per_node: int, coords=None) -> MeshCheck:
    """Every rank's place in the runtime's mesh for `layout` at `world_size` ranks (fake process group, in this
    process). `coords`: the runtime's rank -> (pp, dp, tp) (`layout.coords` unless a test breaks it)."""
    import torch

    from ..runtime.engines.mesh import MESH_DIMS, build_mesh
    from .fake import fake_world

    coords = coords or layout.coords
    with fake_world(world_size):
        grid = build_mesh(layout, torch.device("cpu")).mesh.tolist()
    out = MeshCheck(dict(zip(MESH_DIMS, _shape(grid), strict=True)))
    want = {"pp": layout.pp, "tp": layout.tp}
    for dim, size in want.items():
        if out.shape[dim] != size:
            out.problems.append(f"the mesh's {dim} dimension has {out.shape[dim]} ranks, the plan {size}")
    if out.shape["dp_replicate"] * out.shape["dp_shard"] != layout.dp:
        out.problems.append(
            f"the mesh's data-parallel dimensions hold {out.shape['dp_replicate'] * out.shape['dp_shard']} ranks, "
            f"the plan {layout.dp}"
        )
    seen: dict[int, tuple[int, ...]] = {}
    for p, reps in enumerate(grid):
        for r, shards in enumerate(reps):
            for s, tps in enumerate(shards):
                nodes = {rank // gpus_per_node for rank in tps}
                if len(nodes) > 1:
                    out.problems.append(f"tensor group {tps} spans nodes {sorted(nodes)}")
                for t, rank in enumerate(tps):
                    if rank in seen:
                        out.problems.append(f"rank {rank} is in the mesh twice, at {seen[rank]} and {(p, r, s, t)}")
                    seen[rank] = (p, r, s, t)
                    runtime = coords(rank)
                    mesh = (p, r * out.shape["dp_shard"] + s, t)
                    if tuple(runtime) != mesh:
                        out.problems.append(
                            f"rank {rank} is at (pp {mesh[0]}, dp {mesh[1]}, tp {mesh[2]}) in the mesh, but the "
                            f"runtime places it at (pp {runtime[0]}, dp {runtime[1]}, tp {runtime[2]})"
                        )
    missing = sorted(set(range(world_size)) - set(seen))
    if missing:
        out.problems.append(f"{len(missing)} ranks are not in the mesh, e.g. {missing[:4]}")
    return out


def _shape(grid) -> list[int]:
    dims = []
    while isinstance(grid, list):
        dims.append(len(grid))
        grid = grid[0]
    return dims
