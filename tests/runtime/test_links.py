"""Preflight per node and per link. The GEMM burn-in: every rank's rate recorded, a slow one named. One node's
all-reduce: reported on its own, never held against the network profile. The pairwise test: every link of the
nodes' ring and of each node's local ring is measured on its own and lands in the preflight record; a slow node
(the test-only `slow_link` fault delays its ranks' exchanges: a bad cable or NIC) is localised by its two slow
ring links, named, and only its ranks exit 44, so the SLURM job script excludes it alone. Three simulated nodes:
three torchrun agents here, each with its node name."""

from __future__ import annotations

import pytest

from launcher.jobenv import ExitCode
from launcher.runtime.preflight import ring_rounds
from rt_harness import recipe_dict, run_torchrun, write_plan


def test_the_rings_rounds_cover_every_link_once_and_no_member_twice_in_a_round():
    for members in range(2, 10):
        rounds = ring_rounds(members)
        links = [ln for r in rounds for ln in r]
        want = {(0, 1)} if members == 2 else {(i, (i + 1) % members) for i in range(members)}
        assert set(links) == want and len(links) == len(want), (members, rounds)
        for r in rounds:
            ends = [m for ln in r for m in ln]
            assert len(ends) == len(set(ends)), (members, r)
    assert ring_rounds(1) == [] and len(ring_rounds(4)) == 2 and len(ring_rounds(5)) == 3


NODES = [{"SLURMD_NODENAME": f"n{i}"} for i in (1, 2, 3)]


def _links_run(run_dir, fault: str | None, fraction: float, nodes: int = 3, per_node: int = 1):
    rec = recipe_dict(
        resources={"network": "loopback", "accelerator": f"cpu:{per_node}", "nodes": nodes},
        training={"min_allreduce_fraction": fraction, "steps": 2},
    )
    env = {"DTLAUNCH_FAULT": fault} if fault else {}
    return run_torchrun(
        write_plan(run_dir, rec), run_dir, nproc=per_node, nnodes=nodes, env=env, node_env=NODES[:nodes], timeout=240
    )


@pytest.mark.slow
def test_every_link_and_node_is_measured_and_recorded(run_dir):
    """Two nodes of two ranks: the preflight record holds each rank's node (the key to every figure by rank, the
    GEMM burn-in's among them), the link between the nodes (their first local ranks'), the link inside each node, and each node's free space where the run directory is."""
    res = _links_run(run_dir, None, 0.0, nodes=2, per_node=2)
    assert res.rc == 0, res.output[-3000:]
    (pre,) = res.events("preflight")
    assert pre["nodes"] == ["n1", "n1", "n2", "n2"] and len(pre["gemm_tflops"]) == 4, pre
    assert [(ln["ranks"], ln["nodes"]) for ln in pre["links"]] == [([0, 2], ["n1", "n2"])]  # the nodes' first ranks
    assert [(ln["ranks"], ln["nodes"]) for ln in pre["intra_links"]] == [([0, 1], ["n1", "n1"]), ([2, 3], ["n2", "n2"])]
    assert all(ln["gbps"] > 0 for ln in pre["links"] + pre["intra_links"]), pre
    assert sorted(pre["node_free_bytes"]) == ["n1", "n2"] and all(b > 0 for b in pre["node_free_bytes"].values())
    assert "pairwise between nodes: 1 link(s), the slowest" in res.stdout
    assert "pairwise inside nodes: 2 link(s)" in res.stdout


@pytest.mark.slow
def test_a_slow_nodes_two_links_name_it_and_only_its_ranks_exit_44(run_dir):
    res = _links_run(run_dir, "slow_link:step=0:node=n2:seconds=0.2", 0.5)
    status = res.statuses()
    assert {r: s["code"] for r, s in status.items()} == {
        0: ExitCode.PREEMPTED,
        1: ExitCode.PREFLIGHT,
        2: ExitCode.PREEMPTED,
    }, res.output[-4000:]
    assert status[1]["node"] == "n2"
    (pre,) = res.events("preflight")
    speed = {tuple(ln["nodes"]): ln["gbps"] for ln in pre["links"]}
    assert speed[("n1", "n2")] < 0.1 and speed[("n2", "n3")] < 0.1 and speed[("n3", "n1")] > 0.1, speed
    assert "the slow link(s) point at node(s) n2 (both of its ring links are slow)" in res.output
    assert "link n1 <-> n2 (ranks 0 <-> 1)" in res.output and "below 50% of the 'loopback' profile" in res.output
    assert not res.losses()


@pytest.mark.slow
def test_one_nodes_preflight_names_a_slow_gemm_rank_and_does_not_hold_its_all_reduce_against_the_network(run_dir):
    """One node of two ranks, against the 'best' profile at 90%, rank 1 slow from step 0 (the `slow` fault: a
    throttled device; of the preflight, it slows only the GEMM burn-in, not the all-reduce or the links).
    The GEMM burn-in: rank 1's rate is a robust outlier against rank 0's, named with its node; both ranks' TFLOPS
    are in the preflight record. On a CPU there is no peak to hold them against, so nothing fails.
    The all-reduce: inside one node it runs over NVLink or PCIe (here loopback), not the network: it is reported
    on its own and never failed against the inter-node profile (it used to be: a good single node failed
    preflight against 'best' at 90%)."""
    rec = recipe_dict(resources={"network": "best"}, training={"min_allreduce_fraction": 0.9, "steps": 2})
    res = run_torchrun(write_plan(run_dir, rec), run_dir, env={"DTLAUNCH_FAULT": "slow:rank=1:step=0:seconds=0.05"})
    assert res.rc == 0, res.output[-3000:]
    (pre,) = res.events("preflight")
    fast, slow = pre["gemm_tflops"]
    assert 0 < slow < fast / 2, pre["gemm_tflops"]
    assert "GEMM burn-in (fp32 256^3 (CPU)):" in res.stdout
    assert "WARNING: GEMM burn-in: rank 1 on" in res.stdout and "rank 0 on" not in res.stdout
    assert "on one node (2 ranks)" in res.stdout and "inside a node" in res.stdout
    assert pre["ok"] and pre["intra_node_gbps"] > 0 and "allreduce_fraction" not in pre
