"""The safetensors exporter writes every byte even when the kernel writes less than asked per call (Linux writes
at most ~2 GiB per pwrite: a 70B model's embedding is ~4 GB)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from launcher.runtime.checkpoint.export import SafetensorsWriter  # noqa: E402


def test_short_writes_resume_at_the_right_byte(tmp_path, monkeypatch):
    real = os.pwrite

    def short(fd, data, offset):  # at most 100 bytes per call, as a huge tensor meets the 2 GiB limit
        return real(fd, memoryview(data).cast("B")[:100], offset)

    tensors = {"emb": torch.randn(37, 11), "w": torch.randn(5, 3, 7), "b": torch.randn(13)}
    w = SafetensorsWriter(tmp_path / "model.safetensors", {k: tuple(v.shape) for k, v in tensors.items()}, {})
    monkeypatch.setattr(os, "pwrite", short)
    for name, t in tensors.items():
        w.write(name, t)
    monkeypatch.setattr(os, "pwrite", real)
    back = safetensors_torch.load_file(str(w.close()))
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
