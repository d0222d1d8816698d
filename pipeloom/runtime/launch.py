"""Join the process group ``torchrun`` describes, or run as a world of one rank without it."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipeloom.runtime.comm.threads import end_group_at_exit

__all__ = ["init_ranks"]


def init_ranks() -> tuple[dist.ProcessGroup | None, torch.device]:
    """``(group, device)``: under ``torchrun`` (``RANK`` set), the default group, initialised with NCCL
    and this rank's GPU (``LOCAL_RANK``) when CUDA is available, else gloo on the CPU; without torchrun,
    ``None`` (a world of one rank) and the GPU if there is one."""
    if "RANK" not in os.environ:
        return None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        end_group_at_exit()
    return dist.group.WORLD, device
