"""A training script that forgets ``engine.close()`` (and, without ``--destroy``, also
``dist.destroy_process_group()``), or with ``--refused`` one whose ``pipeline()`` is refused before any engine
exists; test_exit.py launches it with torchrun: every rank must exit 0."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeloom.runtime import pipeline


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if "--refused" in argv:  # pipeline() refuses before any engine exists, and the script forgets the group
        try:
            pipeline(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)), schedule="1f1b", split_points=["9"],
                     loss_fn=F.cross_entropy, microbatches=4)
        except ValueError as error:
            print(f"rank {dist.get_rank()} refused: {str(error)[:40]}", flush=True)
        return 0
    engine = pipeline(schedule="1f1b", stages=[nn.Linear(8, 8), nn.Linear(8, 3)], loss_fn=F.cross_entropy,
                      microbatches=4)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    for _ in range(3):
        loss = engine.step(x, target=y)
    print(f"rank {dist.get_rank()} loss {float(loss):.6f}", flush=True)
    if "--destroy" in argv:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
