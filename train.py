"""Train a UNet for semantic segmentation, on one device or with DistributedDataParallel.

    python train.py --epochs 5 --batch-size 4 --scale 0.5 --amp
    torchrun --nproc_per_node=4 train.py --ddp_mode --epochs 5 --batch-size 4
    torchrun --nnodes=2 --node_rank=R --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --nproc_per_node=8 \\
        train.py --ddp_mode ...
    python train.py ... --resume auto        # continue the run in checkpoints/<exp_name>/

Exit status: 0 when training finished (or stopped at --max-steps), 2 for a user error (one ``Error:`` line on
stderr), 130/143 when SIGINT/SIGTERM stopped it (after INTERRUPTED.pth was written).
"""

from __future__ import annotations

import logging
import signal
import sys

import torch

from utils.cli import setup_logging
from utils.distributed import DistributedContext, teardown
from utils.errors import USER_ERROR_EXIT_CODE, UserError
from utils.training.config import TrainConfig, parse_config
from utils.training.interrupts import InterruptFlag, exit_code_for
from utils.training.loop import TrainOutcome
from utils.training.setup import build_trainer, join, launch_plan

logger = logging.getLogger("train")

# How gloo words it when another process died (closed connection) or stopped answering (--dist-timeout); NCCL and
# the rendezvous store raise torch.distributed.DistError instead. Compared in lower case.
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out waiting",
    "timeout caused pair closure",
    "socket timeout",
)

OOM_MESSAGE = (
    "CUDA ran out of memory; lower --batch-size or --scale, or use --amp and/or --checkpointing "
    "(activation checkpointing)"
)


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    interrupts = InterruptFlag()
    ctx: DistributedContext | None = None
    try:
        config = parse_config(raw_argv)
        plan = launch_plan(config, raw_argv)
        setup_logging(plan.rank, plan.world_size)
        # Installed before the process group exists, so that a signal during set-up is not lost either.
        interrupts.install()
        ctx = join(config, plan)
        trainer = build_trainer(config, ctx, interrupts)
        try:
            outcome = trainer.train()
        finally:
            trainer.close()
    except UserError as error:
        print(f"Error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except torch.cuda.OutOfMemoryError:
        print(f"Error: {OOM_MESSAGE}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except (torch.distributed.DistError, RuntimeError) as error:
        # A rank died or stopped answering: NCCL and store errors are DistErrors, gloo's are RuntimeErrors.
        if not _lost_contact(error):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"Error: lost contact with another training process ({first_line}); see the other processes' logs, "
            "then continue with --resume auto (under torchrun, --max-restarts does that by itself)",
            file=sys.stderr,
        )
        return 1
    except SystemExit as exit_request:  # --help
        return exit_request.code if isinstance(exit_request.code, int) else 0
    finally:
        interrupts.restore()
        if ctx is not None:
            teardown(ctx)
    return _report(config, ctx, outcome)


def _lost_contact(error: Exception) -> bool:
    """Whether ``error`` says another process of the job died or stopped answering."""
    if isinstance(error, torch.distributed.DistError):
        return True
    message = str(error).lower()
    return any(marker in message for marker in PEER_FAILURE_MARKERS)


def _report(config: TrainConfig, ctx: DistributedContext, outcome: TrainOutcome) -> int:
    position = outcome.position
    if outcome.interrupted_by:
        name = signal.Signals(outcome.interrupted_by).name
        if ctx.is_main and outcome.checkpoint is None:
            logger.warning(
                "Stopped by %s at epoch %d, step %d, without saving (the latest step was skipped for NaN/inf "
                "gradients). To continue from the newest checkpoint, run the same command with --resume auto",
                name,
                position.epoch + 1,
                position.global_step,
            )
        elif ctx.is_main:
            logger.warning(
                "Stopped by %s at epoch %d, step %d; saved %s. To continue, run the same command with --resume auto "
                "(or --resume %s)",
                name,
                position.epoch + 1,
                position.global_step,
                outcome.checkpoint,
                outcome.checkpoint,
            )
        else:
            logger.warning("Stopped by %s at step %d together with rank 0", name, position.global_step)
        return exit_code_for(outcome.interrupted_by)
    if outcome.reached_max_steps:
        logger.info(
            "Stopped after --max-steps %d; %s holds the state (continue with --resume auto and a larger --max-steps)",
            config.max_steps,
            outcome.checkpoint or "the newest checkpoint of the run folder",
        )
        return 0
    logger.info("Training complete (%d steps); best validation Dice %.4f", position.global_step, position.best_dice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
