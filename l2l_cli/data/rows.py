"""Token rows with per-token labels, for the decoder tasks that do not train on every token alike
(``task=chat``) or that read a stream (``task.streaming``): a split held in memory (:class:`Rows`), and
rows made on the fly from a stream with the position an exact resume needs (:class:`RowMaker`,
:class:`StreamedTrain`).

A row's ``labels`` are its ids where the loss counts and ``IGNORE`` (-100) elsewhere; its ``docs`` number
the examples packed into it (1, 2, ...), which the batch carries as its ``attention_mask``: the decoders
keep attention inside each example and restart positions at each (``models/decoder.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from l2l_cli.data.batches import Batch
from l2l_cli.data.sources import RowStream

IGNORE = -100  # a label the loss skips (the decoders' cross-entropy ignore_index)

Encoded = tuple[list[int], list[int]]  # one example's (ids, labels)
Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # (ids, labels, docs), int32 each


def collate_rows(rows: list[Row], pad_to: int) -> Batch:
    """Rows as a right-padded batch: padding has id 0, label IGNORE and document 0."""
    import torch  # here, not at the top: l2l plan reads the task kinds without torch

    n = len(rows)
    ids = torch.zeros(n, pad_to, dtype=torch.long)
    labels = torch.full((n, pad_to), IGNORE, dtype=torch.long)
    docs = torch.zeros(n, pad_to, dtype=torch.long)
    for r, (i, lab, d) in enumerate(rows):
        k = len(i)
        ids[r, :k] = torch.from_numpy(i.astype(np.int64))
        labels[r, :k] = torch.from_numpy(lab.astype(np.int64))
        docs[r, :k] = torch.from_numpy(d.astype(np.int64))
    return Batch(ids, torch.zeros_like(ids), docs, labels)


def pack_examples(examples: list[Encoded], seq_len: int, packing: bool) -> list[Row]:
    """One row per example, or (``packing``) whole examples in order into rows of at most ``seq_len``
    tokens, a new row where the next one does not fit (an example is never split across rows)."""
    rows: list[Row] = []
    cur: list[Encoded] = []
    for ex in examples:
        if cur and (not packing or sum(len(e[0]) for e in cur) + len(ex[0]) > seq_len):
            rows.append(join(cur))
            cur = []
        cur.append(ex)
    if cur:
        rows.append(join(cur))
    return rows


def join(examples: list[Encoded]) -> Row:
    ids = np.asarray([t for e in examples for t in e[0]], dtype=np.int32)
    labels = np.asarray([t for e in examples for t in e[1]], dtype=np.int32)
    docs = np.asarray([n for n, e in enumerate(examples, start=1) for _ in e[0]], dtype=np.int32)
    return ids, labels, docs


@dataclass
class Rows:
    """One split's rows (what ``TrainStream`` and ``eval_batches`` read, like ``Encoded``/``Packed``)."""

    rows: list[Row]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def input_ids(self) -> list[np.ndarray]:
        return [r[0] for r in self.rows]

    @property
    def seq_len(self) -> int:
        return max((len(r[0]) for r in self.rows), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(len(r[0]) for r in self.rows)

    def subset(self, n: int | None) -> Rows:
        return self if n is None or n >= len(self) else Rows(self.rows[:n])

    def collate(self, idx: list[int], pad_to: int) -> Batch:
        return collate_rows([self.rows[i] for i in idx], pad_to)


class RowMaker:
    """Rows made from a stream's examples as they are read. ``how``: ``blocks`` (``task=lm``: the
    examples end to end, cut every ``seq_len`` tokens), ``packed`` (whole examples per row, numbered) or
    ``padded`` (one example per row). ``encode(index, row)`` gives an example's (ids, labels), or None to
    skip the row (an empty document). ``state()`` is where it stands after the last row: the stream's
    position and the tokens read but not yet placed in a row."""

    def __init__(
        self,
        source: RowStream,
        encode: Callable[[int, dict[str, Any]], Encoded | None],
        seq_len: int,
        how: str,
    ):
        self.source, self.encode, self.seq_len, self.how = source, encode, seq_len, how
        self.carry: Encoded = ([], [])

    def state(self) -> dict[str, Any]:
        return {"source": self.source.state(), "carry": [list(self.carry[0]), list(self.carry[1])]}

    def seek(self, state: dict[str, Any]) -> None:
        self.source.seek(state["source"])
        self.carry = (list(state["carry"][0]), list(state["carry"][1]))

    def example(self) -> Encoded:
        while True:
            index, row = self.source.next()
            enc = self.encode(index, row)
            if enc is not None:
                return enc

    def row(self) -> Row:
        seq = self.seq_len
        if self.how == "blocks":
            ids, labels = self.carry
            while len(ids) < seq:
                more = self.example()
                ids, labels = ids + more[0], labels + more[1]
            self.carry = (ids[seq:], labels[seq:])
            return join([(ids[:seq], labels[:seq])])
        if self.how == "padded":
            return join([self.example()])
        cur = [self.carry] if self.carry[0] else [self.example()]
        while True:
            nxt = self.example()
            if sum(len(e[0]) for e in cur) + len(nxt[0]) > seq:
                self.carry = nxt
                return join(cur)
            cur.append(nxt)


class StreamedTrain:
    """Training minibatches of a streamed split (``task.streaming``), in the stream's order: a global
    minibatch is the next ``batch_size * world`` rows, rank r takes its ``batch_size`` of them (every
    rank reads the stream, so N ranks see what one process with N times the batch sees). ``position()``
    after a minibatch goes into the checkpoint; ``seek`` puts a resumed run back there."""

    steps_per_epoch = 0  # a stream has no epochs: trainer.max_steps sets the run's length

    def __init__(
        self,
        maker: RowMaker,
        batch_size: int,
        *,
        world: int = 1,
        rank: int = 0,
        pad_to_max: int | None = None,
    ):
        self.maker, self.batch_size, self.world, self.rank = maker, batch_size, world, rank
        self.global_batch, self.pad_to_max = batch_size * world, pad_to_max
        self._position = maker.state()
        self._sought = False

    def position(self) -> dict[str, Any]:
        return self._position

    def seek(self, position: dict[str, Any]) -> None:
        self.maker.seek(position)
        self._position, self._sought = position, True

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        if start_step and not self._sought:
            raise ValueError("a streamed split resumes from the position its checkpoint recorded")
        while True:
            rows = [self.maker.row() for _ in range(self.global_batch)]
            self._position = self.maker.state()
            pad = self.pad_to_max or max(len(r[0]) for r in rows)
            yield collate_rows(rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size], pad)
