"""The facts everything else stands on: model shapes, accelerators, network profiles.

Kept as plain data so the planner stays a set of pure functions and a user can read, in
one place, every number a plan depends on. Imports nothing of ours.
"""

from __future__ import annotations

import msgspec


class ModelShape(msgspec.Struct, frozen=True):
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool = False
    seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Biases some Hugging Face decoders have (Qwen2: q/k/v; Llama with attention_bias / mlp_bias): counted in
    # the parameters; dtlaunch's own Llama has none.
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False


# Shapes copied from the official configs (Meta's params.json / HF config.json).
PRESETS: dict[str, ModelShape] = {
    # Llama 2 (Touvron et al. 2023): 7B, 13B, 70B.
    "llama2-7b": ModelShape(32, 4096, 11008, 32, 32, 32000, seq_len=4096),
    "llama2-13b": ModelShape(40, 5120, 13824, 40, 40, 32000, seq_len=4096),
    "llama2-70b": ModelShape(80, 8192, 28672, 64, 8, 32000, seq_len=4096),
    # Llama 3 / 3.1 (Dubey et al. 2024): 128K vocabulary, rope theta 500000.
    "llama3-8b": ModelShape(32, 4096, 14336, 32, 8, 128256, seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelShape(80, 8192, 28672, 64, 8, 128256, seq_len=8192, rope_theta=500000.0),
    "llama3-405b": ModelShape(126, 16384, 53248, 128, 8, 128256, seq_len=8192, rope_theta=500000.0),
    # CPU-sized presets for the local target, tests and benchmarks.
    "tiny": ModelShape(4, 128, 352, 4, 2, 512, seq_len=128),
    "micro": ModelShape(2, 64, 176, 4, 2, 256, seq_len=64),
    "small-50m": ModelShape(8, 512, 1408, 8, 8, 32000, seq_len=256),
}


class Accelerator(msgspec.Struct, frozen=True):
    name: str
    memory_gb: float  # GB = 1e9 bytes, as vendors quote it
    peak_tflops: float  # dense bf16 (fp16 where bf16 is absent), per device
    usd_per_hour: float  # a typical on-demand list price per device; recipes override it
    bf16: bool = True
    is_gpu: bool = True


# Names spelled as SkyPilot spells them. Peaks are dense (no sparsity) tensor-core figures from
# the vendors' data sheets; prices are representative on-demand list prices (override per recipe).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in [
        Accelerator("B200", 180, 2250, 6.00),
        Accelerator("H200", 141, 989, 4.00),
        Accelerator("H100", 80, 989, 3.00),
        Accelerator("H100-MEGA", 80, 989, 3.20),
        Accelerator("GH200", 96, 989, 3.50),
        Accelerator("A100-80GB", 80, 312, 1.80),
        Accelerator("A100", 40, 312, 1.30),
        Accelerator("L40S", 48, 362, 1.10),
        Accelerator("L4", 24, 121, 0.70),
        Accelerator("A10G", 24, 70, 1.00),
        Accelerator("A10", 24, 125, 0.75),
        Accelerator("V100-32GB", 32, 125, 2.50, bf16=False),
        Accelerator("V100", 16, 125, 2.50, bf16=False),
        Accelerator("T4", 16, 65, 0.35, bf16=False),
        # The local target: one "device" is one process on the host CPU. Memory is a budget per rank.
        Accelerator("cpu", 8, 0.05, 0.0, is_gpu=False),
    ]
}


# Dense (no sparsity) bf16 tensor-core peaks, TFLOPS per device, keyed by the exact name
# torch.cuda.get_device_name() reports: what MFU is measured against in a running job. The data sheets'
# headline figures are with 2:4 sparsity, twice these (H100 SXM: 1,979 sparse, 989 dense). Parts sold in
# several forms differ: an H100 PCIe has fewer SMs and lower clocks than the SXM board.
DEVICE_PEAK_TFLOPS: dict[str, float] = {
    "NVIDIA B200": 2250,
    "NVIDIA H200": 989,
    "NVIDIA H100 80GB HBM3": 989,  # SXM5
    "NVIDIA H100": 989,  # SXM5 on some drivers
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835,
    "NVIDIA GH200 480GB": 989,
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-SXM4-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA A100-PCIE-40GB": 312,
    "NVIDIA L40S": 362,
    "NVIDIA L4": 121,
    "NVIDIA A10G": 70,
    "NVIDIA A10": 125,
    "Tesla V100-SXM2-32GB": 125,  # fp16: no bf16 on V100 and T4
    "Tesla V100-SXM2-16GB": 125,
    "Tesla T4": 65,
}


class Network(msgspec.Struct, frozen=True):
    name: str
    description: str
    node_gbps: float  # expected all-reduce bus bandwidth between nodes, GB/s (1e9 bytes)
    nccl_env: dict[str, str] = msgspec.field(default_factory=dict)
    sky_network_tier: str | None = None


# NCCL settings per fabric: only what differs from NCCL's own detection. NCCL picks interfaces, GPUDirect
# levels and protocols itself, and overriding them has broken jobs: NCCL_SOCKET_IFNAME bypasses its
# interface selection (and can pick a veth or docker bridge), NCCL_PROTO is a debugging knob, and
# FI_EFA_USE_DEVICE_RDMA=1 makes libfabric abort on EFA instances without RDMA read (g5, g6, ...).
# Bandwidths are conservative ring all-reduce bus bandwidths; preflight measures the real figure.
NETWORKS: dict[str, Network] = {
    n.name: n
    for n in [
        Network(
            "best",
            "the fastest fabric the cluster offers (InfiniBand/RoCE on SLURM, SkyPilot network_tier: best)",
            40.0,
            {},
            sky_network_tier="best",
        ),
        Network(
            "infiniband",
            "InfiniBand or RoCE with GPUDirect RDMA",
            40.0,
            {"NCCL_IB_TIMEOUT": "22"},  # retransmission timeout 4.096us * 2^22: rides out congestion at scale
            sky_network_tier="best",
        ),
        Network(
            "efa",
            "AWS Elastic Fabric Adapter (libfabric, aws-ofi-nccl)",
            40.0,
            {"FI_PROVIDER": "efa"},
            sky_network_tier="best",
        ),
        Network(
            "tcp",
            "plain Ethernet sockets",
            2.0,
            {"NCCL_IB_DISABLE": "1", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "2"},
            sky_network_tier="standard",
        ),
        Network("loopback", "one machine (local target, tests)", 0.2, {}, sky_network_tier=None),
    ]
}

# Failure rate: Llama 3 training saw 419 unexpected interruptions in 54 days on 16,384 GPUs
# (Dubey et al. 2024, sec. 3.3.4) -> 54*24*16384/419 = ~50,700 GPU-hours between failures.
GPU_MTBF_HOURS = 50_700.0
# Aggregate checkpoint write bandwidth per node to shared storage, GB/s (a parallel FS, conservative).
STORAGE_GBPS_PER_NODE = 2.0


def parse_accelerator(spec: str) -> tuple[str, int]:
    """`H100:8` -> ("H100", 8); `H100` -> ("H100", 1). Strict, as SkyPilot spells it: no spaces, ASCII digits,
    no empty count. Raises ValueError with the reason."""
    name, sep, count = spec.partition(":")
    if not name or name != name.strip():
        raise ValueError(f"{spec!r}: the accelerator name is empty or has spaces; write TYPE:COUNT, e.g. H100:8")
    if not sep:
        return name, 1
    if not (count.isascii() and count.isdigit()) or not 1 <= int(count) <= 1024:
        raise ValueError(
            f"{spec!r}: the count after ':' must be a whole number from 1 to 1024 in ASCII digits, "
            "with no spaces, e.g. H100:8"
        )
    return name, int(count)
