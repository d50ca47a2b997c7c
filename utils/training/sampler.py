"""Shard arithmetic: which images each rank trains on, in which order, from which position of the epoch.

The order of an epoch is a pure function of ``(seed, epoch)``, the same permutation ``DistributedSampler`` draws, so
a run resumed from a checkpoint sees exactly the images the uninterrupted run would have seen, and one process sees
the same global batches as N processes (rank r takes every N-th image: global batch k is the union of the ranks'
batches k).

Position inside an epoch is counted in *global* images consumed: after ``s`` batches of ``b`` images on ``W`` ranks
the first ``s * b * W`` images of the epoch's order are done, whatever ``W`` was. A resumed run skips them by slicing
the index list, so skipped images are never loaded, and then deals the rest to its own ranks, which also works when
the world size changed between the two runs.

Foreground oversampling (--oversample-foreground P, after nnU-Net's) keeps both properties: ``oversampled_order``
is a pure function of ``(seed, epoch, world_size)`` that forces a fraction P of each rank's positions, spread evenly
over its batches, to images containing a non-background class. The order depends on the world size (each rank's
share must hold the fraction), so with oversampling one process no longer sees N processes' global batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data.distributed import DistributedSampler


def epoch_order(dataset_len: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global order of one epoch: DistributedSampler's permutation for ``seed + epoch``."""
    if not shuffle:
        return list(range(dataset_len))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=generator).tolist()


def oversampled_order(
    dataset_len: int, foreground: Sequence[int], *, fraction: float, seed: int, epoch: int, world_size: int
) -> list[int]:
    """``epoch_order`` with a fraction ``fraction`` of every rank's positions given to ``foreground`` images.

    Rank r takes positions ``r, r + W, ...``; its ``t``-th position (``t = i // W``) is forced when
    ``floor((t + 1) * P) > floor(t * P)``, so each rank's forced share is exactly P over the epoch, spread evenly
    over its batches. Forced positions take the foreground images in a shuffled cycle; the others take the epoch's
    permutation in order (its tail, as many images as were forced, waits for another epoch).
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if fraction > 0 and not foreground:
        raise ValueError("foreground oversampling needs at least one foreground image")
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    base = torch.randperm(dataset_len, generator=generator).tolist()  # epoch_order's permutation
    cycle = [foreground[k] for k in torch.randperm(len(foreground), generator=generator).tolist()]
    order, next_base, next_foreground = [], 0, 0
    for position in range(dataset_len):
        t = position // world_size
        if math.floor((t + 1) * fraction) > math.floor(t * fraction):
            order.append(cycle[next_foreground % len(cycle)])
            next_foreground += 1
        else:
            order.append(base[next_base])
            next_base += 1
    return order


def shard_indices(order: list[int], *, rank: int, world_size: int, consumed: int = 0) -> list[int]:
    """Rank ``rank``'s remaining indices after the first ``consumed`` images of ``order``.

    The remainder is padded (repeating the start of ``order``, as DistributedSampler does) to a multiple of
    ``world_size`` so every rank gets the same number of images and therefore the same number of steps.
    """
    remaining = order[min(consumed, len(order)) :]
    if not remaining:
        return []
    padding = (-len(remaining)) % world_size
    padded = remaining + (order * math.ceil(padding / len(order)))[:padding]
    return padded[rank::world_size]


def batches_per_epoch(dataset_len: int, *, world_size: int, batch_size: int) -> int:
    """Batches each rank runs in a full epoch (the last one may be smaller)."""
    return math.ceil(math.ceil(dataset_len / world_size) / batch_size)


def images_consumed(batches_done: int, *, batch_size: int, world_size: int) -> int:
    """Global images of an epoch's order that ``batches_done`` batches on every rank have used."""
    return batches_done * batch_size * world_size


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a run, computed once: every global batch and step count comes from here."""

    n_train: int
    """Training images in the dataset (all ranks together)."""
    batch_size: int
    """Images per process per micro-batch (--batch-size)."""
    world_size: int
    grad_accum: int = 1
    """Micro-batches per optimizer step (--grad-accum)."""

    @property
    def global_batch(self) -> int:
        """Images of one micro-batch on all ranks together."""
        return self.batch_size * self.world_size

    @property
    def images_per_step(self) -> int:
        """Images of one optimizer step on all ranks together (the effective batch size)."""
        return self.global_batch * self.grad_accum

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches each rank runs in a full epoch (the last one may be smaller)."""
        return batches_per_epoch(self.n_train, world_size=self.world_size, batch_size=self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a full epoch (a last, shorter accumulation group still makes one)."""
        return math.ceil(self.batches_per_epoch / self.grad_accum)

    def total_steps(self, epochs: int) -> int:
        """Optimizer steps of ``epochs`` full epochs."""
        return epochs * self.steps_per_epoch


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler (shuffle by ``seed + epoch``, no dropping) that can start part-way through an epoch.

    Also used with one process, so single-process order depends only on ``(seed, epoch)`` like the distributed one.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        foreground: Sequence[int] = (),
        oversample_foreground: float = 0.0,
    ) -> None:
        """``foreground``: the indices whose images contain a non-background class, for ``oversampled_order``."""
        # DistributedSampler only needs len(dataset); a range stands in so the sampler never touches the images.
        super().__init__(range(dataset_len), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
        self._consumed = 0
        self.foreground = list(foreground)
        self.oversample_foreground = oversample_foreground

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Select the epoch's order and skip its first ``consumed`` global images."""
        super().set_epoch(epoch)
        self._consumed = consumed

    def indices(self) -> list[int]:
        if self.oversample_foreground and self.shuffle:
            order = oversampled_order(
                len(self.dataset),
                self.foreground,
                fraction=self.oversample_foreground,
                seed=self.seed,
                epoch=self.epoch,
                world_size=self.num_replicas,
            )
        else:
            order = epoch_order(len(self.dataset), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        return shard_indices(order, rank=self.rank, world_size=self.num_replicas, consumed=self._consumed)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        remaining = max(0, len(self.dataset) - self._consumed)
        return math.ceil(remaining / self.num_replicas)
