"""Train a UNet for semantic segmentation, on one device or with DistributedDataParallel.

    python train.py --epochs 5 --batch-size 4 --scale 0.5 --amp
    torchrun --nproc_per_node=4 train.py --ddp_mode --epochs 5 --batch-size 4
    torchrun --nnodes=2 --node_rank=R --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --nproc_per_node=8 \\
        train.py --ddp_mode ...
    python train.py ... --resume auto        # continue the run in checkpoints/<exp_name>/
    python train.py --load ck.pth --start_from 6 --epochs 5   # five more epochs, numbered 6..10

Exit status: 0 when training finished (or stopped at --max-steps), 2 for a user error (one ``Error:`` line on
stderr, printed by global rank 0 when every rank has it; out of memory too), 1 when another rank died or stopped
answering, 130/143 when SIGINT/SIGTERM stopped it (after INTERRUPTED.pth was written); see ``run_main`` in
``utils/launch/process_group.py``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: a signal while they run is one line or remembered (SLURM's)
    from utils.launch.signals import catch_signals_from_start

    catch_signals_from_start()

import logging  # noqa: E402 - after the start-up handler above, as every import below
import sys

from utils.cli import setup_logging
from utils.launch.environments import launcher_rank, plan_launch
from utils.launch.process_group import RunStage, leave, run_main, teardown
from utils.launch.signals import InterruptFlag, requeue_if_asked, signal_exit_code, stop_when_orphaned
from utils.training.config import parse_config
from utils.training.setup import build_trainer, join

logger = logging.getLogger("train")

OOM_FIX = "lower --batch-size or --scale, or use --amp and/or --checkpointing (activation checkpointing)"


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    # Before the launch plan exists only the launcher's RANK says who prints; every rank parses the same flags.
    stage = RunStage(rank=launcher_rank())
    if stage.rank != 0 and ("-h" in raw_argv or "--help" in raw_argv):
        return 0  # under a launcher the help is printed once, by rank 0
    try:
        return run_main(lambda: _train(raw_argv, stage), oom_fix=OOM_FIX, stage=stage)
    finally:
        if stage.ctx is not None:  # after the error report, which may wait for the other ranks
            teardown(stage.ctx)


def _train(raw_argv: list[str], stage: RunStage) -> int:
    """Parse, join the other ranks, train and report; ``stage`` follows how far it got (who prints an error)."""
    interrupts = InterruptFlag()
    try:
        config = parse_config(raw_argv)
        if not config.launch.ddp_mode:
            stage.rank = 0  # every process is a run of its own (a wrong launch too): each says what stopped it
        plan = plan_launch(config.launch, argv=raw_argv)
        stage.rank = plan.rank
        setup_logging(plan.rank, plan.world_size)
        # Installed before the process group exists, so that a signal during set-up is not lost either.
        interrupts.install(plan.requeue_signal)
        if plan.supervised:
            stop_when_orphaned()  # a worker whose torchrun is killed stops like one sent SIGTERM
        stage.joining = True
        stage.ctx = join(config, plan)
        stage.joining = False
        trainer = build_trainer(config, stage.ctx, interrupts)
        try:
            outcome = trainer.train()
        finally:
            trainer.close()
    finally:
        interrupts.restore()
    if not outcome.interrupted_by:
        logger.info("%s", outcome.line)
        return 0
    logger.warning("%s", outcome.line)
    requeue_if_asked(stage.ctx, outcome.interrupted_by)
    return signal_exit_code(outcome.interrupted_by)


if __name__ == "__main__":
    leave(main())  # a short shutdown: a job ends as soon as its work is done
