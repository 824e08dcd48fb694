"""A strict torch.distributed for CPU tests: what NCCL and CUDA would refuse, refused on gloo and the CPU.

On a CPU every tensor is on one device and gloo takes anything, so a host tensor handed to an NCCL group (or
a device tensor to a gloo one) passes the CPU suite and kills the first multi-GPU run. ``StrictDist`` gives
each process group a *declared* backend (``nccl`` where the run asked for it, or where it would pick it on
CUDA: ``pretend_nccl``), creates every group on gloo underneath, and checks each collective and p2p op
against the declared backend:

- NCCL: every tensor must be a device tensor; gloo: every tensor a host tensor;
- NCCL: the product's point-to-point ops only inside ``batch_isend_irecv`` (unbatched ops between two ranks
  run in the order posted, safe only while both ranks' orders mirror; torch's own schedules are torch's);
- an in-place op on a host tensor with a device operand, as CUDA refuses it (``copy_`` excepted: copies
  cross devices);
- a pipeline's last stage returning another shape than it declared (``strict_stage_outputs``: torch up to
  2.12 checks it, 2.13 no longer does).

Barriers are counted by their group's declared backend (``"nccl barrier"``), not refused.

Which tensors are *device* tensors: the run's accelerator is given the device ``cpu:0`` (``DEVICE``): the
same CPU, but factories asked for it show the index to a dispatch mode while host factories (no device, or
``cpu``) do not. An op's outputs are device tensors when an input is (an in-place op's destination keeps its
own); ``.cpu()`` and ``.to("cpu")`` of a device tensor give a host copy (as on CUDA); ``.to(DEVICE)`` of a
host one a device copy. Tensors are told apart by their storages (shared by views, ``.data``, parameters).

What it cannot tell: a factory given a device tensor's ``.device`` (``cpu``, without the index) makes a host
tensor here, and C++ code (DDP's buckets) allocates outside the tags; the ordering rules of NCCL's streams
(deadlocks) are not modelled. ``docs/gpu.md`` says what the CPU suite can and cannot see.

``strict_rank_main`` is the product's own rank entry point (``launch._rank_main``: one rank of ``l2l
train``) under the shim, for the elastic launcher to spawn; each rank writes how many tensors each
(backend, collective, kind) checked, so a test sees that the checks ran. ``strict`` is the in-process form.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("cpu", 0)  # "the device": a CPU device whose index factories carry to dispatch
HOST, DEV = "host", "device"


class StrictDistError(RuntimeError):
    """A collective that the declared backend would refuse."""


# ---- which tensors are device tensors ---------------------------------------------------------------


class DeviceTags:
    """Storages of device tensors (weakly held: a storage's Python object lives as long as its memory)."""

    def __init__(self) -> None:
        self.storages: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()

    def tag(self, t: torch.Tensor) -> None:
        if not t.is_meta and t.untyped_storage().nbytes():
            self.storages[t.untyped_storage()] = None

    def untag(self, t: torch.Tensor) -> None:
        self.storages.pop(t.untyped_storage(), None)

    def kind(self, t: torch.Tensor) -> str:
        if t.is_cuda:
            return DEV
        if t.device.type != "cpu" or not t.untyped_storage().nbytes():
            return "any"  # meta, or nothing to move
        return DEV if t.untyped_storage() in self.storages else HOST


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _is_device_arg(device: Any) -> bool:
    return device is not None and torch.device(device) == DEVICE


_CROSSING = ("copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "set_")  # ops that cross devices


class _Propagate(TorchDispatchMode):
    """Tags the outputs of factories asked for ``DEVICE`` and of ops with a device input."""

    def __init__(self, tags: DeviceTags):
        super().__init__()
        self.tags = tags

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        kinds = [(self.tags.kind(t), t.dim()) for t in _tensors((args, kwargs))]
        dev = any(k == DEV for k, _ in kinds)
        if dev and name.endswith("_") and name not in _CROSSING and kinds[0][0] == HOST:
            raise StrictDistError(
                f"{func}: a host tensor updated in place from a device one, as CUDA refuses"
            )
        out = func(*args, **kwargs)
        if name.endswith("_") or "out" in kwargs:
            return out  # in place: the destination keeps its device
        device = _is_device_arg(kwargs["device"]) if "device" in kwargs else dev
        if device:
            for t in _tensors(out):
                self.tags.tag(t)
        return out


def _target_device(args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, str | torch.device):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class _Moves(TorchFunctionMode):
    """``.cpu()``/``.to("cpu")`` of a device tensor: a host copy, and ``.to(DEVICE)`` of a host tensor a
    device copy, as on CUDA (on one CPU torch returns the tensor itself)."""

    def __init__(self, tags: DeviceTags):
        super().__init__()
        self.tags = tags

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and _is_device_arg(kwargs.get("device")):
            self.tags.tag(out)
        if func in (torch.Tensor.cpu, torch.Tensor.to) and args and isinstance(out, torch.Tensor):
            src = args[0]
            target = "cpu" if func is torch.Tensor.cpu else _target_device(args[1:], kwargs)
            if target is None or isinstance(target, torch.Tensor):
                return out
            target = torch.device(target)
            if target.type == "cpu" and target.index is None and self.tags.kind(src) == DEV:
                if out is src or out.untyped_storage() is src.untyped_storage():
                    with torch._C.DisableTorchFunction():
                        out = out.clone()
                self.tags.untag(out)
            elif target == DEVICE and self.tags.kind(src) == HOST:
                if out is src or out.untyped_storage() is src.untyped_storage():
                    with torch._C.DisableTorchFunction():
                        out = out.clone()
                self.tags.tag(out)
        return out


# ---- the strict process groups --------------------------------------------------------------------

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "isend",
    "irecv",
    "send",
    "recv",
)
_P2P = ("isend", "irecv", "send", "recv")
# torch pickles objects into tensors on the device the *real* backend wants (gloo here: the host), and
# moves them to the GPU itself on NCCL: their inner collectives are not checked
_OBJECTS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


class StrictDist:
    """Patches ``torch.distributed`` in this process (see the module's docstring)."""

    def __init__(self, tags: DeviceTags, pretend_nccl: bool):
        self.tags, self.pretend_nccl = tags, pretend_nccl
        self.declared: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, declared backend)
        self.default_backend = "gloo"
        # "<backend> <collective> <tensor kind>": tensors checked; "... elements": their elements
        self.counts: Counter[str] = Counter()
        self._batched = threading.local()
        self._objects_on = threading.local()
        self._inside = threading.local()
        self._orig: dict[str, Any] = {}

    # the declared backend of a group
    def backend_of(self, group: Any) -> str:
        if group is None or group is dist.group.WORLD or group is c10d._get_default_group():
            return self.default_backend
        return self.declared.get(id(group), (None, "gloo"))[1]

    def _declare(self, backend: Any) -> str:
        b = str(backend or self.default_backend).lower()
        return "nccl" if b == "nccl" or (b == "auto" and self.pretend_nccl) else "gloo"

    def install(self) -> None:
        orig = self._orig
        for name in (
            *_COLLECTIVES,
            *_OBJECTS,
            "init_process_group",
            "new_group",
            "batch_isend_irecv",
            "get_backend",
            "barrier",
        ):
            orig[name] = getattr(c10d, name)

        def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
            # the run picks gloo on this CPU; on CUDA ``dist.backend=auto`` picks NCCL: pretend it did
            self.default_backend = "nccl" if self.pretend_nccl else self._declare(backend)
            return orig["init_process_group"]("gloo", *args, **kwargs)

        def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, *args: Any, **kwargs: Any):
            g = orig["new_group"](ranks, timeout, "gloo", *args, **kwargs)
            if g is not None and g is not c10d.GroupMember.NON_GROUP_MEMBER:
                self.declared[id(g)] = (g, self._declare(backend))
            return g

        def get_backend(group: Any = None) -> str:
            return self.backend_of(group)

        def batch_isend_irecv(ops: list) -> Any:
            self._batched.on = True
            try:
                return orig["batch_isend_irecv"](ops)
            finally:
                self._batched.on = False

        def barrier(group: Any = None, *args: Any, **kwargs: Any) -> Any:
            self.counts[f"{self.backend_of(group)} barrier"] += 1  # which group's: a test can ask
            return orig["barrier"](group, *args, **kwargs)

        # the product's view of the backend: torch's internals keep asking c10d (gloo's, the real one)
        mine = {
            "barrier": barrier,
            "init_process_group": init_process_group,
            "new_group": new_group,
            "get_backend": get_backend,
            "batch_isend_irecv": batch_isend_irecv,
        }
        for name, fn in mine.items():
            setattr(dist, name, fn)
        for name in _OBJECTS:
            wrapped = self._objects(orig[name])
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)
        for name in _COLLECTIVES:
            wrapped = self._wrap(name, orig[name])
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)  # P2POp checks its op against the module's isend/irecv

    def _objects(self, fn: Any) -> Any:
        def unchecked(*args: Any, **kwargs: Any) -> Any:
            self._objects_on.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._objects_on.on = False

        return unchecked

    def _wrap(self, name: str, fn: Any) -> Any:
        sig = inspect.signature(fn)

        def checked(*args: Any, **kwargs: Any) -> Any:
            # inside an object collective, or torch's call back into it through a torch-function mode
            if getattr(self._objects_on, "on", False) or getattr(self._inside, "on", False):
                return fn(*args, **kwargs)
            self._inside.on = True
            self._inside.caller = sys._getframe(1).f_globals.get("__name__", "")
            try:
                return check(*args, **kwargs)
            finally:
                self._inside.on = False

        def check(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            backend = self.backend_of(group)
            ours = str(getattr(self._inside, "caller", "")).startswith(
                "l2l_cli"
            )  # (torch's warm-up is torch's)
            if name in _P2P and backend == "nccl" and ours and not getattr(self._batched, "on", False):
                raise StrictDistError(
                    f"{name}: a point-to-point op on a group declared nccl outside batch_isend_irecv (NCCL "
                    "runs two ranks' unbatched ops to each other in the order posted: they must mirror)"
                )
            for key, value in bound.arguments.items():
                if key in ("group", "op"):
                    continue
                for t in _tensors(value):
                    kind = self.tags.kind(t)
                    if kind == "any":
                        continue
                    if (backend == "nccl") != (kind == DEV):
                        why = (
                            "NCCL moves device tensors only"
                            if backend == "nccl"
                            else "gloo moves host tensors"
                        )
                        raise StrictDistError(
                            f"{name}: a {kind} tensor {tuple(t.shape)} {t.dtype} on a group declared "
                            f"{backend} ({why})"
                        )
                    self.counts[f"{backend} {name} {kind}"] += 1
                    self.counts[f"{backend} {name} {kind} elements"] += t.numel()
            return fn(*args, **kwargs)

        checked.__name__ = name
        checked.__signature__ = sig  # type: ignore[attr-defined]
        return checked

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)
            setattr(c10d, name, fn)

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(dict(self.counts), indent=1, sort_keys=True))


@contextmanager
def strict(pretend_nccl: bool) -> Iterator[StrictDist]:
    """The shim and the device tags in this process, for the block (in-process tests)."""
    tags = DeviceTags()
    shim = StrictDist(tags, pretend_nccl)
    shim.install()
    try:
        with _Propagate(tags), _Moves(tags):
            yield shim
    finally:
        shim.uninstall()


def strict_stage_outputs() -> None:
    """Every pipeline stage's forward outputs checked against the metadata it declared, the last stage's
    included: torch up to 2.12 checks them all (``_validate_fwd_outputs``), 2.13 skips the last stage's."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    run = _PipelineStageBase.forward_one_chunk

    def forward_one_chunk(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = run(self, *args, **kwargs)
        meta = getattr(getattr(self, "_user_meta", None), "outputs", None)
        if self.is_last and meta:
            got = [tuple(t.shape) for t in _tensors(out)]
            want = [tuple(m.shape) for m in meta if m is not None]
            if got != want:
                raise StrictDistError(
                    f"stage {self.stage_index} (the last) declared outputs of shape {want} and returned {got}"
                )
        return out

    _PipelineStageBase.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]


# ---- a rank under the strict shim --------------------------------------------------------------------

_STATE: dict[str, Any] = {}


def install_in_rank(pretend_nccl: bool) -> StrictDist:
    """Strict groups, device tags on the main thread, the accelerator on ``DEVICE``, and, with
    ``pretend_nccl``, the default group declared NCCL as ``dist.backend=auto`` makes it on CUDA (the
    product reads its backend from ``dist.get_backend()``, so its groups follow)."""
    from l2l_cli import session
    from l2l_cli.engine import accelerators

    tags = DeviceTags()
    modes = [_Propagate(tags), _Moves(tags)]
    for m in modes:
        m.__enter__()
    shim = StrictDist(tags, pretend_nccl)
    shim.install()
    strict_stage_outputs()
    make = accelerators.make_accelerator

    def make_accelerator(kind: str, **kwargs: Any) -> Any:
        acc = make(kind, **kwargs)
        acc.device = DEVICE
        return acc

    session.make_accelerator = make_accelerator  # type: ignore[assignment]
    _STATE.update(shim=shim, modes=modes)
    return shim


def strict_rank_main(cfg_yaml: str, run_dir: str, pretend_nccl: bool, counts_dir: str) -> str:
    """The product's rank entry point (``launch._rank_main``: the whole ``l2l train`` of one rank, its
    trainer, evaluation and checkpoints) under the strict shim; each rank writes its counts."""
    from l2l_cli.launch import _rank_main

    shim = install_in_rank(pretend_nccl)
    try:
        return _rank_main(cfg_yaml, run_dir)
    finally:
        shim.dump(Path(counts_dir) / f"rank{os.environ.get('RANK', '0')}.json")
        for m in reversed(_STATE.pop("modes", [])):
            m.__exit__(None, None, None)
