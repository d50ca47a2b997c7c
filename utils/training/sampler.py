"""Shard arithmetic: which images each rank trains on, in which order, from which position of the epoch.

The order of an epoch is a pure function of ``(seed, epoch)``, the same permutation ``DistributedSampler`` draws, so
a run resumed from a checkpoint sees exactly the images the uninterrupted run would have seen, and one process sees
the same global batches as N processes (rank r takes every N-th image: global batch k is the union of the ranks'
batches k).

Position inside an epoch is counted in *global* images consumed: after ``s`` batches of ``b`` images on ``W`` ranks
the first ``s * b * W`` images of the epoch's order are done, whatever ``W`` was. A resumed run skips them by slicing
the index list, so skipped images are never loaded, and then deals the rest to its own ranks, which also works when
the world size changed between the two runs.

Foreground oversampling (--oversample-foreground P, after nnU-Net's) keeps both properties: ``epoch_order`` with
a fraction P is a pure function of ``(seed, epoch, world_size)`` that forces a fraction P of each rank's positions,
spread evenly over its batches, to images containing a non-background class. The order depends on the world size
(each rank's share must hold the fraction), so with oversampling one process no longer sees N processes' global
batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler


def epoch_order(
    dataset_len: int,
    *,
    seed: int,
    epoch: int,
    foreground: Sequence[int] = (),
    fraction: float = 0.0,
    world_size: int = 1,
) -> list[int]:
    """The global order of one epoch: DistributedSampler's permutation for ``seed + epoch``, with a ``fraction`` of
    every rank's positions given to ``foreground`` images (--oversample-foreground; 0: none).

    Rank r takes positions ``r, r + W, ...``; its ``t``-th position (``t = i // W``) is forced when
    ``floor((t + 1) * P) > floor(t * P)``, so each rank's forced share is exactly P over the epoch, spread evenly
    over its batches. Forced positions take the foreground images in a shuffled cycle; the others take the epoch's
    permutation in order (its tail, as many images as were forced, waits for another epoch).

    ``fraction`` in [0, 1] and, above 0, at least one ``foreground`` image: checked where the flag is parsed
    (its ``range=``, ``utils.flags.check_range``) and where the loaders are built (``build_loaders`` names the flag).
    """
    generator = torch.Generator().manual_seed(seed + epoch)
    permutation = torch.randperm(dataset_len, generator=generator).numpy()
    if not fraction:
        return permutation.tolist()
    cycle = np.asarray(foreground)[torch.randperm(len(foreground), generator=generator).numpy()]
    share = np.arange(dataset_len) // world_size  # each position's number in its rank's share
    forced = np.floor((share + 1) * fraction) > np.floor(share * fraction)
    order = np.empty_like(permutation)
    order[forced] = cycle[np.arange(forced.sum()) % len(cycle)]
    order[~forced] = permutation[: dataset_len - forced.sum()]
    return order.tolist()


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


def images_per_rank(dataset_len: int, *, world_size: int, consumed: int = 0) -> int:
    """Images each rank gets of an epoch whose first ``consumed`` global images are done (``shard_indices`` pads the
    rest to a multiple of ``world_size``). ``BatchPlan`` counts batches from it; the sampler's length is it."""
    return math.ceil(max(0, dataset_len - consumed) / world_size)


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a run: every batch and step count (the loop's, the loaders', a resume's) comes from
    here, and nothing else computes one."""

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

    def images_per_rank(self, consumed: int = 0) -> int:
        """Images each rank trains of an epoch whose first ``consumed`` global images are done."""
        return images_per_rank(self.n_train, world_size=self.world_size, consumed=consumed)

    def batches_done(self, consumed: int) -> int:
        """Micro-batches of this plan that ``consumed`` global images of an epoch make up (whole ones)."""
        return consumed // self.global_batch

    def batches_in_epoch(self, consumed: int = 0) -> int:
        """Number of the epoch's last micro-batch plus one, for an epoch resumed after ``consumed`` global images.

        The ``batches_done(consumed)`` already trained plus this run's batches of the rest; the same as a full
        epoch's unless the resumed run's batch size or world size differs from the saving run's.
        """
        return self.batches_done(consumed) + math.ceil(self.images_per_rank(consumed) / self.batch_size)

    def images_consumed(self, batches_done: int) -> int:
        """Global images of an epoch's order that ``batches_done`` micro-batches on every rank have used."""
        return batches_done * self.global_batch

    def accumulation_group(self, index: int, batches_in_epoch: int) -> range:
        """The micro-batches of the optimizer step that micro-batch ``index`` belongs to: groups of ``grad_accum``
        from the epoch's start, the last one shorter when the epoch's ``batches_in_epoch`` does not divide. The step
        opens with the group's ``start`` and closes with its last batch (``group[-1]``); ``len(group)`` divides the
        loss."""
        start = index - index % self.grad_accum
        return range(start, min(start + self.grad_accum, batches_in_epoch))

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a full epoch (a last, shorter accumulation group still makes one)."""
        return math.ceil(self.batches_in_epoch() / self.grad_accum)

    def total_steps(self, epochs: int) -> int:
        """Optimizer steps of ``epochs`` full epochs."""
        return epochs * self.steps_per_epoch


@dataclass
class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler's shards (shuffled by ``seed + epoch``, none dropped) that can start part-way through an
    epoch, with --oversample-foreground's order (``epoch_order``).

    Also used with one process, so single-process order depends only on ``(seed, epoch)`` like the distributed one.
    """

    dataset_len: int
    rank: int
    world_size: int
    seed: int
    foreground: Sequence[int] = ()
    """The indices whose images contain a non-background class, for ``oversample_foreground``."""
    oversample_foreground: float = 0.0
    epoch: int = 0
    consumed: int = 0
    """Global images of the epoch's order already done: skipped."""

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Select the epoch's order and skip its first ``consumed`` global images."""
        self.epoch, self.consumed = epoch, consumed

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(
            self.dataset_len,
            seed=self.seed,
            epoch=self.epoch,
            foreground=self.foreground,
            fraction=self.oversample_foreground,
            world_size=self.world_size,
        )
        return iter(shard_indices(order, rank=self.rank, world_size=self.world_size, consumed=self.consumed))

    def __len__(self) -> int:
        return images_per_rank(self.dataset_len, world_size=self.world_size, consumed=self.consumed)
