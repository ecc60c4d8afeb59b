"""Token data: where the tokens come from, which sequences each rank reads, and where we are in the epoch.

The order of samples depends only on (seed, epoch, global sample index), never on the world size: each
epoch is one permutation of all sequences, cut into global batches of G sequences, and rank r of W reads
every W-th sample of its batch (DistributedSampler's interleaving). So global batch k holds the same
sequences whatever W is, the position saved in a checkpoint is world-independent (epoch, samples
consumed in the epoch), and a 2-rank checkpoint resumed on 1 rank continues with exactly the next batch.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .failures import ConfigError

DTYPES = {"uint16": (torch.uint16, 2), "uint32": (torch.uint32, 4), "bytes": (torch.uint8, 1)}


class SyntheticTokens:
    """A seeded, learnable stream: a random walk with small steps through a shuffled vocabulary.

    Each next token depends only on the previous one (a bigram Markov chain with entropy ~0.9 nats),
    so the loss visibly falls from ln(vocab) within a few dozen steps; identical on every rank and run.
    """

    STEPS = torch.tensor([1, 2, 3], device="cpu")
    PROBS = torch.tensor([0.6, 0.3, 0.1], device="cpu")

    def __init__(self, num_tokens: int, vocab: int, seed: int, stream: int = 0):
        """`stream` > 0: another walk through the same chain (the same shuffled vocabulary, its own moves), for
        held-out data that the training stream (0) never contains by construction."""
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(vocab, generator=g, device="cpu")
        if stream:
            g = torch.Generator().manual_seed((seed * 1_000_003 + stream) % 2**63)
        moves = self.STEPS[torch.multinomial(self.PROBS, num_tokens, replacement=True, generator=g)]
        start = torch.randint(0, vocab, (1,), generator=g, device="cpu")
        walk = (start + torch.cumsum(moves, 0)) % vocab
        self.tokens = perm[walk].to(torch.int32)
        self.vocab = vocab

    def __len__(self) -> int:
        return self.tokens.numel()

    def window(self, start: int, n: int) -> torch.Tensor:
        return self.tokens[start : start + n].long()


def _npy_header(path: Path) -> tuple[str, int, int]:
    """(dtype descr, offset of the data, element count) of a 1-D .npy file, without numpy."""
    with open(path, "rb") as f:
        magic = f.read(6)
        if magic != b"\x93NUMPY":
            raise ConfigError(f"{path}: not a .npy file")
        major = f.read(2)[0]
        hlen_bytes = 2 if major == 1 else 4
        hlen = int.from_bytes(f.read(hlen_bytes), "little")
        header = ast.literal_eval(f.read(hlen).decode("latin1"))
        offset = 6 + 2 + hlen_bytes + hlen
    if header.get("fortran_order") or len(header.get("shape", ())) != 1:
        raise ConfigError(f"{path}: expected a 1-D token array, got shape {header.get('shape')}")
    return header["descr"], offset, int(header["shape"][0])


class FileTokens:
    """Tokens read from a local file with pread: no numpy, no full load, safe across forked workers."""

    def __init__(self, path: str | os.PathLike, dtype: str):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(
                f"data file {self.path} not found", fix="set training.data.path to a token file on every node"
            )
        offset = 0
        if self.path.suffix == ".npy":
            descr, offset, count = _npy_header(self.path)
            dtype = {"<u2": "uint16", "<u4": "uint32", "|u1": "bytes"}.get(descr) or ""
            if not dtype:
                raise ConfigError(f"{self.path}: dtype {descr!r} not supported", fix="save tokens as uint16 or uint32")
        self.torch_dtype, self.itemsize = DTYPES[dtype]
        self.offset = offset
        size = self.path.stat().st_size - offset
        if size % self.itemsize:
            raise ConfigError(
                f"{self.path}: {size} bytes is not a whole number of {dtype} tokens",
                fix="check training.data.dtype (uint16, uint32 or bytes)",
            )
        self.count = size // self.itemsize
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.count

    def window(self, start: int, n: int) -> torch.Tensor:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        raw = os.pread(self._fd, n * self.itemsize, self.offset + start * self.itemsize)
        return torch.frombuffer(bytearray(raw), dtype=self.torch_dtype).to(torch.int64)

    def __getstate__(self):
        return {**self.__dict__, "_fd": None}


def token_source(data_spec, vocab: int, seed: int):
    if data_spec.source == "synthetic":
        return SyntheticTokens(data_spec.num_tokens, vocab, seed)
    if data_spec.dtype == "bytes" and vocab < 256:
        raise ConfigError(
            f"byte-level text needs a vocabulary of at least 256, the model has {vocab}",
            fix="use a larger vocab, or tokenise the text into a .bin file",
        )
    return FileTokens(data_spec.path, data_spec.dtype)


def sequences_in(source, seq_len: int) -> int:
    return (len(source) - 1) // seq_len


class TokenDataset(Dataset):
    """Sample i = tokens [(first+i)*seq, (first+i+1)*seq] (seq+1 tokens: inputs and shifted targets), for `count`
    samples (default: to the end of the source)."""

    def __init__(self, source, seq_len: int, vocab: int, first: int = 0, count: int | None = None):
        self.source, self.seq_len, self.vocab = source, seq_len, vocab
        self.first = first
        self.n = sequences_in(source, seq_len) - first if count is None else count

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        i += self.first
        w = self.source.window(i * self.seq_len, self.seq_len + 1)
        top = int(w.max())
        if top >= self.vocab:
            raise ConfigError(
                f"token id {top} in sequence {i} is outside the model's vocabulary ({self.vocab})",
                fix="check training.data.dtype, or use a model with a larger vocab",
            )
        return w


class GlobalOrderSampler(DistributedSampler):
    """DistributedSampler whose order is world-independent and which can start mid-epoch.

    Only whole global batches are used per epoch (floor(N / G) of them), so the epoch length is the
    same for every world size; `start_step` skips the batches already trained on.
    """

    dataset: TokenDataset

    def __init__(self, dataset: TokenDataset, num_replicas: int, rank: int, global_batch: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        if global_batch % num_replicas:
            raise ConfigError(f"global batch {global_batch} does not divide by the {num_replicas} data-parallel ranks")
        self.global_batch = global_batch
        self.steps_per_epoch = len(dataset) // global_batch
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"the data holds {len(dataset)} sequences, fewer than one global batch ({global_batch})",
                fix="add data (training.data.num_tokens for synthetic) or lower training.global_batch",
            )
        self.start_step = 0

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of all sample indices; a function of (seed, epoch) only."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=g, device="cpu")

    def __iter__(self) -> Iterator[int]:
        used = self.order(self.epoch)[: self.steps_per_epoch * self.global_batch]
        mine = used[self.start_step * self.global_batch + self.rank :: self.num_replicas]
        return iter(mine.tolist())

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.global_batch // self.num_replicas


@dataclass
class DataPosition:
    """Where the next step reads from; world-independent, saved in every checkpoint."""

    epoch: int = 0
    step_in_epoch: int = 0  # global batches already consumed in this epoch
    global_batch: int = 0

    @property
    def sample_in_epoch(self) -> int:
        return self.step_in_epoch * self.global_batch

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_batch": self.global_batch,
            "sample_in_epoch": self.sample_in_epoch,
        }


def rescale_position(saved: dict, global_batch: int) -> tuple[DataPosition, str | None]:
    """The position for a (possibly) different global batch, and a warning when it cannot be exact."""
    samples = int(saved.get("sample_in_epoch", saved.get("step_in_epoch", 0) * saved.get("global_batch", global_batch)))
    pos = DataPosition(int(saved.get("epoch", 0)), samples // global_batch, global_batch)
    warn = None
    if samples % global_batch:
        warn = (
            f"global batch changed {saved.get('global_batch')} -> {global_batch}: {samples % global_batch} samples "
            f"of epoch {pos.epoch} are trained on twice"
        )
    return pos, warn


class Batches:
    """Yields one optimizer step's micro-batches at a time and tracks the data position."""

    def __init__(
        self,
        dataset: TokenDataset,
        sampler: GlobalOrderSampler,
        loader: DataLoader,
        grad_accum: int,
        device: torch.device,
    ):
        self.dataset, self.sampler, self.loader = dataset, sampler, loader
        self.grad_accum, self.device = grad_accum, device
        self.position = DataPosition(0, 0, sampler.global_batch)
        self._it: Iterator | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def seek(self, pos: DataPosition) -> None:
        if pos.step_in_epoch >= self.steps_per_epoch:
            pos = DataPosition(pos.epoch + 1, 0, pos.global_batch)
        self.position = pos
        self._it = None

    def _start_epoch(self) -> Iterator:
        self.sampler.set_epoch(self.position.epoch)
        self.sampler.start_step = self.position.step_in_epoch
        self._it = iter(self.loader)
        return self._it

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum (inputs, targets) pairs for the next optimizer step."""
        it = self._it if self._it is not None else self._start_epoch()
        out = []
        for _ in range(self.grad_accum):
            batch = next(it)
            batch = batch.to(self.device, non_blocking=True)
            out.append((batch[:, :-1], batch[:, 1:]))
        self.position = DataPosition(self.position.epoch, self.position.step_in_epoch + 1, self.position.global_batch)
        if self.position.step_in_epoch >= self.steps_per_epoch:
            self.position = DataPosition(self.position.epoch + 1, 0, self.position.global_batch)
            self._it = None
        return out


def build_dataloader(
    data_spec,
    *,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    grad_accum: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    is_gpu: bool,
    held_out: int = 0,
) -> Batches:
    """The training data for this rank. Workers and pinned memory only on GPU (they only cost on CPU).
    `held_out`: sequences at the end of a token file that training never reads (`build_eval_data`'s); synthetic
    data holds out a stream of its own, so its training data is the same with or without them.

    Workers are started once and kept (persistent) across epochs and seeks: re-forking them each time stalled the
    step, from a process that by then holds CUDA and NCCL threads; and they are started by a fork server, whose
    clean process holds neither (a fork of a threaded process copies its locks in whatever state they are)."""
    source = token_source(data_spec, vocab, seed)
    count = None
    if held_out and data_spec.source == "file":
        count = _trained_sequences(data_spec, source, seq_len, held_out)
    dataset = TokenDataset(source, seq_len, vocab, count=count)
    global_batch = micro_batch * grad_accum * world_size
    sampler = GlobalOrderSampler(dataset, world_size, rank, global_batch, seed)
    workers = data_spec.workers if is_gpu else 0
    loader = DataLoader(
        dataset,
        batch_size=micro_batch,
        sampler=sampler,
        num_workers=workers,
        pin_memory=is_gpu and torch.cuda.is_available(),
        drop_last=True,
        persistent_workers=workers > 0,
        multiprocessing_context="forkserver" if workers else None,
        # each iter() draws its workers' base seed from this generator; without one it draws from torch's
        # global generator, and the extra iter() of a resume mid-epoch would shift every random op after it
        # (dropout) away from the uninterrupted run's
        generator=torch.Generator().manual_seed(seed),
    )
    return Batches(dataset, sampler, loader, grad_accum, device)


def _trained_sequences(data_spec, source, seq_len: int, held_out: int) -> int:
    """The sequences of a token file before the `held_out` last ones."""
    total = sequences_in(source, seq_len)
    if total <= held_out:
        raise ConfigError(
            f"{data_spec.path} holds {total} sequences of {seq_len} tokens, not more than the {held_out} held out "
            "for the validation loss",
            fix="lower training.eval_batches, set training.eval_every: 0, or add data",
        )
    return total - held_out


def held_out_sequences(global_batch: int, eval_batches: int) -> int:
    """How many sequences the validation loss reads: whole global batches, so the held-out part of a token file
    (and with it the training data) does not change with the world size."""
    return global_batch * eval_batches


class EvalData:
    """The held-out sequences, the same at every evaluation: rank r of W reads every W-th of them, in micro-batches.
    Every rank reads as many, so the mean of the ranks' means is the mean over all of them, whatever W is."""

    def __init__(self, dataset: TokenDataset, micro_batch: int, rank: int, world_size: int):
        self.dataset, self.micro_batch, self.rank, self.world_size = dataset, micro_batch, rank, world_size

    def micro_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mine = list(range(self.rank, len(self.dataset), self.world_size))
        for i in range(0, len(mine), self.micro_batch):
            batch = torch.stack([self.dataset[j] for j in mine[i : i + self.micro_batch]]).to(device)
            yield batch[:, :-1], batch[:, 1:]


def build_eval_data(
    data_spec,
    *,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    eval_batches: int,
    rank: int,
    world_size: int,
    seed: int,
) -> EvalData:
    """The validation data for this data-parallel rank: `eval_batches` global batches that training never reads (a
    synthetic run's own held-out stream, or a token file's last sequences: `build_dataloader(held_out=...)`)."""
    n = held_out_sequences(global_batch, eval_batches)
    if data_spec.source == "synthetic":
        dataset = TokenDataset(SyntheticTokens(n * seq_len + 1, vocab, seed, stream=1), seq_len, vocab)
    else:
        source = token_source(data_spec, vocab, seed)
        dataset = TokenDataset(source, seq_len, vocab, first=_trained_sequences(data_spec, source, seq_len, n), count=n)
    return EvalData(dataset, micro_batch, rank, world_size)
