"""A tensor-parallel group of threads standing in for SGLang's GroupCoordinator in the CPU tests of the
sharded draft top-k (the drop-in's, and the bench's reproduction of the port's)."""

from __future__ import annotations

import threading

import torch


class ThreadGroup:
    """A tensor-parallel group of `world` threads (rank = the thread's `rank` attribute)."""

    def __init__(self, world: int):
        self.world_size, self.slots = world, [None] * world
        self.barrier, self.local = threading.Barrier(world), threading.local()

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out <- every rank's inp in rank order (out [world * n, ...] or [world, n, ...])."""
        self.slots[self.local.rank] = inp.clone()
        self.barrier.wait()
        out.copy_(torch.stack(self.slots).view(out.shape))
        self.barrier.wait()
