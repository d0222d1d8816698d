"""Pipeline × data parallel: ``pipeline(..., mesh=mesh)`` over a ``DeviceMesh`` with dimensions ``"pp"``
and, optionally, ``"dp"``.

Every rank gets the global batch; the batch is cut into ``M × dp`` micro-batches (``torch.chunk``, as
one device would cut it) and replica ``r`` runs micro-batches ``r·M … r·M + M − 1``, a contiguous share.
Each micro-batch's loss is divided by ``M × dp`` (docs/design.md §5 over the global batch), so the replicas'
gradients sum to the global batch's. They are summed over ``"dp"`` in buckets: a stage's bucket is
posted (an asynchronous all-reduce) as soon as the stage's last gradient action of the step has run, so
the reduction overlaps the rest of the schedule. Parameters whose gradient is settled only at the end of
the step — shared parameters (after their exchange) and every parameter of a two-replica schedule
(after the replicas' merge) — are reduced then. Every replica ends with the same bits; against one
device over the global batch the sum is only associated differently (docs/runtime.md states the bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.parallel.ep import ExpertParallel, expert_layout
from pipeloom.runtime.parallel.tp import TensorParallel, local_of, mesh_coordinates, with_local
from pipeloom.runtime.state.state_dict import Wait

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["BUCKET_BYTES", "DataParallel", "GradientBuckets", "Layout", "layout_of"]

BUCKET_BYTES = 25 * 2**20  # the most gradient bytes one all-reduce carries
_NAMES = ("pp", "dp", "tp", "ep")


@dataclass(frozen=True, slots=True)
class DataParallel:
    """This rank's place among the pipeline's replicas."""

    group: dist.ProcessGroup | None  # the "dp" process group (None when size is 1)
    rank: int  # this replica's index: it runs micro-batches rank·M … rank·M + M − 1
    size: int
    mesh: DeviceMesh | None = None  # the "dp" sub-mesh (for FSDP), when the mesh has that dimension (with "ep":
    # the replicas, every dimension but "pp")


@dataclass(frozen=True, slots=True)
class Layout:
    """The process groups one engine runs on."""

    rank: int  # rank in the pipeline group
    world: int  # ranks of one pipeline
    group: dist.ProcessGroup | None  # the pipeline ("pp") group; None for a world of one
    dp: DataParallel
    everyone: dist.ProcessGroup | None  # a group of every rank of the mesh (agreement on each step, the shared seed)
    everyone_size: int
    device_type: str | None  # the mesh's device type, when a mesh was given
    tp: TensorParallel = TensorParallel()  # the "tp" dimension (pipeloom.runtime.parallel.tp); size 1 without one
    coordinates: dict[int, str] | None = None  # with "tp": every global rank -> its mesh coordinates
    ep: ExpertParallel = ExpertParallel()  # the "ep" dimension (pipeloom.runtime.parallel.ep); size 1 without one

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group the engine communicates on."""
        found = (self.group, self.everyone, self.dp.group, self.tp.group, self.ep.group, self.ep.dp_group)
        return list({id(g): g for g in found if g is not None}.values())

    def where(self, number: int | None = None) -> str:
        """``global rank G (pp 1, tp 0)`` for global rank ``number`` (this one by default) on a mesh with
        "tp"; ``""`` elsewhere (messages there name pipeline ranks, as before)."""
        if self.coordinates is None:
            return ""
        number = dist.get_rank() if number is None else number
        return f"global rank {number} ({self.coordinates.get(number, 'outside the mesh')})"


def layout_of(process_group: dist.ProcessGroup | None, mesh: DeviceMesh | None) -> Layout:
    """The groups from ``process_group`` (one pipeline) or ``mesh`` (pipelines × replicas)."""
    if mesh is None:
        rank, world, group = _world_of(process_group)
        return Layout(rank=rank, world=world, group=group, dp=DataParallel(group=None, rank=0, size=1),
                      everyone=group, everyone_size=world, device_type=None)
    if process_group is not None:
        raise PipelineError("give process_group= or mesh=, not both (the mesh's \"pp\" dimension is the pipeline)")
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or not hasattr(mesh, "get_group"):
        raise PipelineError("mesh= takes a torch.distributed.device_mesh.DeviceMesh with named dimensions, e.g. "
                            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'pp'))")
    unknown = [n for n in names if n not in _NAMES]
    if unknown or "pp" not in names:
        raise PipelineError(f"the mesh's dimensions are {list(names)}; pipeloom runs a \"pp\" dimension and, "
                            "optionally, \"dp\", \"tp\" and \"ep\": name them mesh_dim_names=('dp', 'pp', 'tp')")
    _check_covered(mesh, names)
    group = mesh.get_group("pp")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dp = DataParallel(group=None, rank=0, size=1)
    if "dp" in names and mesh.size(names.index("dp")) > 1:
        dp_group = mesh.get_group("dp")
        dp = DataParallel(group=dp_group, rank=dist.get_rank(dp_group), size=dist.get_world_size(dp_group),
                          mesh=mesh["dp"])
    tp, coordinates = TensorParallel(), None
    if "tp" in names:
        tp_group = mesh.get_group("tp")
        tp = TensorParallel(group=tp_group, rank=dist.get_rank(tp_group), size=dist.get_world_size(tp_group),
                            mesh=mesh["tp"])
        coordinates = mesh_coordinates(mesh)
    ep = ExpertParallel()
    if "ep" in names:  # the dp × ep ranks of this "pp" coordinate are the replicas; experts shard over "ep"
        ep, replicas = expert_layout(mesh, names)
        if ep.size > 1:
            together = replicas.get_group()
            dp = DataParallel(group=together, rank=dist.get_rank(together), size=dist.get_world_size(together),
                              mesh=replicas)
        coordinates = mesh_coordinates(mesh)
    everyone: dist.ProcessGroup | None = group
    everyone_size = world
    if dp.size > 1 or tp.size > 1:
        everyone, everyone_size = dist.group.WORLD, dist.get_world_size()
    return Layout(rank=rank, world=world, group=group, dp=dp, everyone=everyone, everyone_size=everyone_size,
                  device_type=mesh.device_type, tp=tp, coordinates=coordinates, ep=ep)


def _check_covered(mesh: DeviceMesh, names: tuple[str, ...]) -> None:
    """Refuse, on every rank and before any of the mesh's groups is used, a rank outside the mesh, and a mesh with
    replicas or tensor parallelism that leaves ranks out (their steps would wait on ranks that never come)."""
    world = dist.get_world_size()
    held = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    sizes = {name: mesh.size(k) for k, name in enumerate(names)}
    wide = [f'"{name}"' for name in ("dp", "tp", "ep") if sizes.get(name, 1) > 1]
    if wide and len(held) != world:
        raise PipelineError(f"the mesh holds {len(held)} of the {world} ranks; with {' and '.join(wide)} pipeloom "
                            "needs a mesh over every rank of the default process group")
    if mesh.get_coordinate() is None:
        ranks = f"ranks {held[0]}-{held[-1]}" if held == list(range(held[0], held[-1] + 1)) else f"ranks {held}"
        raise PipelineError(f"global rank {dist.get_rank()} is not in mesh= (it holds {ranks} of {world}); call "
                            "pipeline() only on the mesh's ranks, or give a mesh over every rank")


def _world_of(process_group: dist.ProcessGroup | None) -> tuple[int, int, dist.ProcessGroup | None]:
    """(rank, world size, group) — a world of one when no process group exists."""
    if process_group is not None:
        return dist.get_rank(process_group), dist.get_world_size(process_group), process_group
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    return 0, 1, None


@dataclass(slots=True)
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor
    work: dist.Work


@dataclass(slots=True)
class GradientBuckets:
    """One training step's gradient reduction over ``"dp"`` (see the module doc).

    :meth:`begin` sets the parameters' gradients aside, so the step leaves only its own in ``.grad``;
    :meth:`stage_done` posts a stage's buckets; :meth:`finish` posts the rest, waits, and leaves
    ``.grad`` = what was set aside + the sum over replicas.
    """

    dp: DataParallel
    stage_params: dict[int, list[nn.Parameter]]  # local stage -> its trainable parameters
    late: set[int]  # ids of parameters reduced only in finish()
    wait: Wait
    over: dict[int, tuple] = field(default_factory=dict)  # parameter id -> (group, size) summed over instead of dp
    saved: dict[int, torch.Tensor | None] = field(default_factory=dict)
    posted: set[int] = field(default_factory=set)
    buckets: list[_Bucket] = field(default_factory=list)

    def _unique(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for p in params:
            seen.setdefault(id(p), p)
        return list(seen.values())

    def begin(self) -> None:
        for p in self._unique([p for ps in self.stage_params.values() for p in ps]):
            self.saved[id(p)] = p.grad
            p.grad = None

    def stage_done(self, stage: int) -> None:
        """The stage's last gradient action ran: post its parameters' buckets (not the late ones)."""
        self._post([p for p in self.stage_params.get(stage, ()) if id(p) not in self.late])

    def _post(self, params: Sequence[nn.Parameter]) -> None:
        todo = [p for p in self._unique(params) if id(p) not in self.posted and p.grad is not None]
        self.posted.update(id(p) for p in params)
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in todo:  # one bucket per dtype, device and group, cut at BUCKET_BYTES
            grad = _grad(p)
            group, size = self.over.get(id(p), (self.dp.group, self.dp.size))
            if size > 1:  # an expert's gradient without "dp" is whole already (pipeloom.runtime.parallel.ep)
                groups.setdefault((grad.dtype, grad.device, group), []).append(p)
        for (_, _, group), members in groups.items():
            start = 0
            while start < len(members):
                size, end = 0, start
                while end < len(members) and (end == start or size + _nbytes(members[end]) <= BUCKET_BYTES):
                    size += _nbytes(members[end])
                    end += 1
                chunk = members[start:end]
                flat = torch.cat([local_of(_grad(p)).reshape(-1) for p in chunk])  # a DTensor's own shard
                work = dist.all_reduce(flat, group=group, async_op=True)
                self.buckets.append(_Bucket(params=chunk, flat=flat, work=work))
                start = end

    def finish(self) -> None:
        """Post what is left, wait for every bucket and put the sums into ``.grad``."""
        self._post([p for ps in self.stage_params.values() for p in ps])
        for bucket in self.buckets:
            self.wait(bucket.work, f"summing gradients over the {self.dp.size} data-parallel replicas")
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                grad = _grad(p)
                local = local_of(grad)
                n = local.numel()
                p.grad = with_local(grad, bucket.flat[offset:offset + n].view_as(local))
                offset += n
        for p in self._unique([p for ps in self.stage_params.values() for p in ps]):
            before = self.saved.get(id(p))
            if before is not None:
                p.grad = before if p.grad is None else before.add_(p.grad)
        self.buckets.clear()


def _grad(p: nn.Parameter) -> torch.Tensor:
    """The gradient of a parameter in a bucket (only parameters with one are bucketed)."""
    assert p.grad is not None
    return p.grad


def _nbytes(p: nn.Parameter) -> int:
    local = local_of(_grad(p))
    return local.numel() * local.element_size()
