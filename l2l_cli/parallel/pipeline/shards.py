"""A pipeline's checkpoints in the one checkpoint layout: no rank holds the whole state, so rank 0 either
gathers every stage's tensors by Hugging Face name (torch's schedules: the baselines' module layout) or
commits the layer files each rank of the first pipeline wrote itself (L2L stages: one process's EPS
layout). Either way a run resumes with any pipeline degree or placement, or none."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from l2l_cli import checkpoint as ckpt
from l2l_cli.parallel.pipeline.state import StageState


def gather_on_rank0(mine: Any, P: int, rank: int, group: Any) -> list[Any] | None:
    """Collective over the first pipeline (``group``, its host group): every rank's ``mine``, in pipeline
    order, on global rank 0 (None elsewhere)."""
    parts: list[Any] | None = [None] * P if rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    return parts


def module_state(stages: Iterable[StageState], dp_group: Any) -> dict[str, dict[str, Any]]:
    """This rank's stages' weights and (once the optimizer has stepped, as the baselines save them) their
    moments, by Hugging Face name, on the host; collective over the data-parallel group (a partitioned
    state's moments are gathered whole first)."""
    mine: dict[str, dict[str, Any]] = {"weights": {}, "moments": {}}
    for st in stages:
        m, v = st.full_moments(dp_group)
        steps = st.steps_taken()
        for (name, w), (_, exp_avg), (_, exp_avg_sq) in zip(st.named(st.w), st.named(m), st.named(v)):
            mine["weights"][name] = w.detach().cpu().clone()
            if steps > 0:
                mine["moments"][name] = {
                    "exp_avg": exp_avg.detach().cpu().clone(),
                    "exp_avg_sq": exp_avg_sq.detach().cpu().clone(),
                    "step": steps,
                }
    return mine


def merge_module_states(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The whole model's weights and moments from every rank's :func:`module_state`."""
    full: dict[str, dict[str, Any]] = {"weights": {}, "moments": {}}
    for part in parts:
        full["weights"] |= part["weights"]
        full["moments"] |= part["moments"]
    return full


def write_layer_files(
    files: Iterable[tuple[str, bytes]], root: Path, step: int, pp_rank: int, P: int, rank: int, group: Any
) -> dict[str, ckpt.Written] | None:
    """Collective over the first pipeline (``group``, its host group): each rank writes its layers' files
    (``files``: one process's EPS layout, by the model's layer number) under step ``step``'s shard
    directory; rank 0 gets their names and checksums, for its checkpoint to rename them in (None on the
    other ranks). No rank ever holds another's state; the manifest rank 0 writes last is the commit."""
    where = ckpt.shard_dir(root, step)
    if pp_rank == 0:  # (a crash's leftovers of this step go first)
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
    dist.barrier(group=group)
    mine = {name: ckpt.write_bytes(where / name, data) for name, data in files}
    parts = gather_on_rank0(mine, P, rank, group)
    if parts is None:
        return None
    return {n: ckpt.Written(where / n, e) for part in parts for n, e in part.items()}


def in_layer_order(shards: dict[str, ckpt.Written]) -> Iterator[tuple[str, ckpt.Written]]:
    """The files :func:`write_layer_files` gathered, in the model's layer order (``layer_<i>.*``)."""
    number = {n: int(n.removeprefix("layer_").split(".")[0]) for n in shards}
    return iter(sorted(shards.items(), key=lambda item: number[item[0]]))
