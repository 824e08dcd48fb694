"""Tokenized datasets and length-bucketed, padded minibatches (sharded per data-parallel rank)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a batch is made: l2l plan reads the task kinds without torch
    import torch


@dataclass
class Batch:
    """A padded minibatch or micro-batch. ``x_BS`` names say the shape: batch x sequence."""

    input_ids: torch.Tensor  # [B, S] int64
    token_type_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S] int64 (1 = token, 0 = padding)
    labels: torch.Tensor  # [B] int64 (classification) or float32 (regression); [B, S] token ids (lm)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def split(self, num_ubatches: int) -> list[Batch]:
        """Equal micro-batches, in order (ubatch u holds rows u*n/k .. (u+1)*n/k)."""
        parts = [t.chunk(num_ubatches) for t in (getattr(self, f.name) for f in fields(self))]
        return [Batch(*p) for p in zip(*parts)]

    def to(self, device: torch.device, *, copy: bool = False) -> Batch:
        """On ``device``; ``copy`` forces a real copy (a device tier on the CPU must own its inputs). To a
        GPU the batch goes through pinned memory (the caching host allocator reuses it), so the copy is
        asynchronous rather than a synchronous copy from pageable memory."""
        if copy:
            return Batch(*(getattr(self, f.name).to(device, copy=True) for f in fields(self)))
        pin = device.type == "cuda"
        return Batch(
            *(
                (t.pin_memory() if pin and t.device.type == "cpu" else t).to(device, non_blocking=True)
                for t in (getattr(self, f.name) for f in fields(self))
            )
        )


@dataclass
class Encoded:
    """A tokenized split: per example its token ids, segment ids and label."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: list[float] | list[int]
    regression: bool

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, n: int | None) -> Encoded:
        if n is None or n >= len(self):
            return self
        return Encoded(self.input_ids[:n], self.token_type_ids[:n], self.labels[:n], self.regression)

    def collate(self, idx: list[int], pad_to: int) -> Batch:
        import torch

        n = len(idx)
        ids = torch.zeros(n, pad_to, dtype=torch.long)
        tt = torch.zeros(n, pad_to, dtype=torch.long)
        mask = torch.zeros(n, pad_to, dtype=torch.long)
        for row, i in enumerate(idx):
            k = len(self.input_ids[i])
            ids[row, :k] = torch.tensor(self.input_ids[i])
            tt[row, :k] = torch.tensor(self.token_type_ids[i])
            mask[row, :k] = 1
        dtype = torch.float32 if self.regression else torch.long
        labels = torch.tensor([self.labels[i] for i in idx], dtype=dtype)
        return Batch(ids, tt, mask, labels)


class TrainStream:
    """Minibatches for training: seeded shuffle per epoch, length bucketing, drop-last.

    A *global* minibatch holds ``batch_size * world`` samples; rank r takes rows
    [r*batch_size, (r+1)*batch_size) and every rank pads to the global minibatch's longest row, so N ranks
    with batch b see exactly the tensors one process with batch N*b sees (the data-parallel equivalence
    tests rely on this).
    """

    BUCKET = 32  # global minibatches per length-sorting bucket

    def __init__(
        self,
        data: Encoded,
        batch_size: int,
        *,
        seed: int,
        world: int = 1,
        rank: int = 0,
        pad_to_max: int | None = None,
    ):
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.world, self.rank, self.pad_to_max = world, rank, pad_to_max
        self.global_batch = batch_size * world
        self.steps_per_epoch = len(data) // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the training set has {len(data)} examples, fewer than one global minibatch "
                f"({batch_size} x {world} ranks); lower batch.size"
            )

    def epoch_order(self, epoch: int) -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.data), generator=g).tolist()
        lengths = [len(self.data.input_ids[i]) for i in perm]
        span = self.global_batch * self.BUCKET
        batches = []
        usable = self.steps_per_epoch * self.global_batch
        for start in range(0, usable, span):
            chunk = sorted(range(start, min(start + span, usable)), key=lambda j: lengths[j])
            for b in range(0, len(chunk), self.global_batch):
                batches.append([perm[j] for j in chunk[b : b + self.global_batch]])
        order = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in order]

    def position(self) -> dict | None:
        """Where the data stands beyond the step (None: the order is a function of the step alone; a
        streamed split's position: ``rows.StreamedTrain``)."""
        return None

    def seek(self, position: dict) -> None:
        raise ValueError("a checkpoint of a streamed split cannot resume a run over an in-memory one")

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Minibatches forever (epoch after epoch), from global step ``start_step`` on."""
        epoch, index = divmod(start_step, self.steps_per_epoch)
        while True:
            order = self.epoch_order(epoch)
            for global_idx in order[index:]:
                pad = self.pad_to_max or max(len(self.data.input_ids[i]) for i in global_idx)
                mine = global_idx[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
                yield self.data.collate(mine, pad)
            epoch, index = epoch + 1, 0


def eval_batches(
    data: Encoded, batch_size: int, pad_to_max: int | None = None
) -> Iterator[tuple[list[int], Batch]]:
    """Evaluation batches sorted by length (less padding); yields (example indices, batch)."""
    order = sorted(range(len(data)), key=lambda i: len(data.input_ids[i]))
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        pad = pad_to_max or max(len(data.input_ids[i]) for i in idx)
        yield idx, data.collate(idx, pad)
