"""The trained weights as one consolidated file (fp32, unsharded), for use outside dtlaunch.

Streamed, one tensor at a time: each is gathered whole over the ranks that hold its shards, moved to the host,
written at its place in the file by rank 0, and dropped. Gathering the whole state first held the full fp32
model on rank 0's host, then a clone of it, then the serialised bytes: three times the model (~840 GB for 70B)
on a node that also runs seven other ranks; and with a pipeline every stage's first rank held its whole stage
unsharded in fp32 on its GPU. A safetensors file can be written in place because its header (names, shapes,
offsets) is known from the global shapes before any byte is gathered.

With a pipeline, each stage's first rank (data-parallel and tensor rank 0) sends its stage's tensors to rank 0
over the gloo checkpoint group, the stages taking turns tensor by tensor, so that no stage waits in a gather
(with the training timeout) while rank 0 writes the others' tensors.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ...version import __version__
from ..engines import DeepSpeedEngine, Engine
from . import disk
from .state import save_torch


class SafetensorsWriter:
    """A safetensors file of fp32 tensors written in place, in any order, from a header known in advance; the
    file appears under its name only when complete (a temporary sibling, fsynced, then renamed)."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]):
        self.path = Path(path)
        header: dict = {"__metadata__": metadata}
        self.offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        at = 0
        for name in sorted(shapes):  # data in name order, as safetensors.torch.save lays out same-dtype tensors
            n = 4 * _numel(shapes[name])
            header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [at, at + n]}
            self.offsets[name] = (at, tuple(shapes[name]))
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.base = 8 + len(raw)
        self.tmp = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.base + at)
        self.left = set(shapes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        at, shape = self.offsets[name]
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        if tuple(t.shape) != shape:
            raise ValueError(f"export: {name} has shape {tuple(t.shape)}, the header says {shape}")
        view = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""  # bytes, so short writes resume right
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.base + at + done)
        self.left.discard(name)

    def close(self) -> Path:
        if self.left:
            raise RuntimeError(f"export: {len(self.left)} tensors were never written (e.g. {sorted(self.left)[:3]})")
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        disk.fsync_path(self.path.parent)
        return self.path

    def abort(self) -> None:
        try:
            os.close(self.fd)
        finally:
            self.tmp.unlink(missing_ok=True)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------- what each engine holds


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole (collective over its shards' ranks when it is a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _torch_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters under the whole model's names (DTensors as such); a weight shared by two modules
    (tied embeddings) once, under its first name, as safetensors requires."""
    return list(module.named_parameters())


def _deepspeed_tensors(engine: DeepSpeedEngine) -> Iterator[tuple[str, tuple[int, ...], object]]:
    for name, p in engine.module.named_parameters():
        yield name, tuple(getattr(p, "ds_shape", p.shape)), p


def _stream(engine: Engine, rank: int, group) -> tuple[dict[str, tuple[int, ...]], Iterator[tuple[str, torch.Tensor]]]:
    """(every tensor's global shape, an iterator of (name, whole tensor) that is non-empty on rank 0 only).
    Every rank must exhaust the iterator: the gathers are collective."""
    if isinstance(engine, DeepSpeedEngine):
        from deepspeed.utils import safe_get_full_fp32_param

        params = list(_deepspeed_tensors(engine))

        def gen():
            for name, _, p in params:
                t = safe_get_full_fp32_param(p)  # a gather under ZeRO-3: every rank calls it
                if rank == 0:
                    yield name, t

        return {n: s for n, s, _ in params}, gen()
    layout = engine.layout
    items = _torch_tensors(engine.module)
    if layout.pp == 1:

        def gen():
            for name, t in items:
                whole = _whole(t)
                if rank == 0:
                    yield name, whole

        return {n: tuple(t.shape) for n, t in items}, gen()
    return _stream_stages(engine, rank, group, items)


def _stream_stages(engine: Engine, rank: int, group, items):
    """A pipeline: each stage's first rank gathers its tensors one by one and sends them to rank 0 over `group`
    (gloo, host tensors), the stages taking turns."""
    pp_rank, dp_rank, tp_rank = engine.layout.coords(rank)
    leader = dp_rank == 0 and tp_rank == 0
    mine = [(n, tuple(t.shape)) for n, t in items]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (pp_rank, leader, mine), group=group)
    stages: dict[int, tuple[int, list]] = {}
    for r, (p, lead, names) in enumerate(every):
        if lead:
            stages[p] = (r, names)
    shapes = {n: s for _, names in stages.values() for n, s in names}
    # The order rank 0 receives in, stage by stage in turn; each stage's own sub-order is its items' order.
    order, i = [], 0
    while any(i < len(names) for _, names in stages.values()):
        for p in sorted(stages):
            src, names = stages[p]
            if i < len(names):
                order.append((names[i][0], names[i][1], src, p))
        i += 1

    def gen():
        own = iter(items)
        for name, shape, src, p in order:
            if p != pp_rank:
                if rank == 0:
                    buf = torch.empty(shape, dtype=torch.float32, device="cpu")
                    dist.recv(buf, src=src, group=group)
                    yield name, buf
                continue
            _, t = next(own)
            whole = _whole(t)  # every rank of this stage takes part
            if rank == 0:
                yield name, whole
            elif leader:
                dist.send(whole.detach().to("cpu", torch.float32).contiguous(), dst=0, group=group)

    return shapes, gen()


# ----------------------------------------------------------------------------- the export


def export_model(engine: Engine, out_dir: Path, fmt: str, rank: int, group=None) -> Path | None:
    """A consolidated single-file copy of the weights on rank 0; collective (every rank gathers). `group`: a gloo
    group for the pipeline stages' transfers (the checkpoint group)."""
    if fmt == "none":
        return None
    shapes, tensors = _stream(engine, rank, group)
    hf_config = getattr(getattr(engine.module, "hf", None), "config", None)
    if fmt == "pt":
        full = {name: t.detach().to("cpu", torch.float32) for name, t in tensors}  # whole on rank 0: small models
        if rank != 0:
            return None
        path = Path(out_dir) / "model.pt"
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        save_torch(full, path)
        return path
    rename = (lambda n: n) if hf_config is None else (lambda n: n[len("hf.") :] if n.startswith("hf.") else None)
    tied = hf_config is not None and getattr(hf_config, "tie_word_embeddings", False)
    keep = {n: r for n in shapes if (r := rename(n)) is not None and not (tied and r == "lm_head.weight")}
    out = Path(out_dir) / "hf" if hf_config is not None else Path(out_dir)
    writer = None
    if rank == 0:
        writer = SafetensorsWriter(
            out / "model.safetensors", {keep[n]: shapes[n] for n in keep}, {"format": "pt", "dtlaunch": __version__}
        )
    try:
        for name, t in tensors:
            if writer is not None and name in keep:
                writer.write(keep[name], t)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is None:
        return None
    path = writer.close()
    if hf_config is not None:
        disk.write_file_durably(out / "config.json", hf_config.to_json_string().encode())
    return path


__all__ = ["SafetensorsWriter", "export_model"]
