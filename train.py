"""Train a UNet for semantic segmentation, on one device or with DistributedDataParallel.

    python train.py --epochs 5 --batch-size 4 --scale 0.5 --amp
    torchrun --nproc_per_node=4 train.py --ddp_mode --epochs 5 --batch-size 4
    torchrun --nnodes=2 --node_rank=R --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --nproc_per_node=8 \\
        train.py --ddp_mode ...
    python train.py ... --resume auto        # continue the run in checkpoints/<exp_name>/
    python train.py --load ck.pth --start_from 6 --epochs 5   # five more epochs, numbered 6..10

Exit status: 0 when training finished (or stopped at --max-steps), 2 for a user error (one ``Error:`` line on
stderr, printed by global rank 0 when every rank has it), 130/143 when SIGINT/SIGTERM stopped it (after
INTERRUPTED.pth was written).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import warnings

import torch

from utils.cli import print_error, setup_logging
from utils.distributed import DistributedContext, barrier, is_raised_on_every_rank, launcher_rank, teardown
from utils.errors import USER_ERROR_EXIT_CODE, UserError
from utils.training.config import TrainConfig, parse_config
from utils.training.interrupts import InterruptFlag, exit_code_for
from utils.training.loop import TrainOutcome
from utils.training.orphans import stop_when_orphaned
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


# How long a rank other than 0 waits before exiting after an error that rank 0 prints. torchrun stops the other
# workers as soon as one exits, so rank 0 must exit first: it has then printed the message, and it is the failure
# torchrun reports. After an agreed error a barrier guarantees the printing, and a moment lets rank 0 leave first.
# A bad flag is found before the processes meet, and rank 0 may still be importing torch: the others wait until
# torchrun stops them (it does as soon as rank 0 has exited), or this long at most.
QUIET_EXIT_DELAY_S = 1.0
QUIET_EXIT_BEFORE_JOINING_S = 60.0


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    interrupts = InterruptFlag()
    ctx: DistributedContext | None = None
    # Before the launch plan exists only the launcher's RANK says who prints; every rank parses the same flags.
    rank, joining = launcher_rank(), False
    if rank != 0 and ("-h" in raw_argv or "--help" in raw_argv):
        return 0  # under a launcher the help is printed once, by rank 0
    try:
        config = parse_config(raw_argv)
        plan = launch_plan(config, raw_argv)
        rank = plan.rank
        setup_logging(plan.rank, plan.world_size)
        if plan.rank != 0:
            _quiet_warnings()
        # Installed before the process group exists, so that a signal during set-up is not lost either.
        interrupts.install()
        if plan.supervised:
            stop_when_orphaned()  # a worker whose torchrun is killed stops like one sent SIGTERM
        joining = True
        ctx = join(config, plan)
        joining = False
        trainer = build_trainer(config, ctx, interrupts)
        try:
            outcome = trainer.train()
        finally:
            trainer.close()
    except UserError as error:
        # A bad flag (before joining) and an error the ranks agreed on reach every rank: rank 0 alone prints it. A
        # failure to join, or one found by one rank alone (say a corrupt image), is printed where it happened.
        shared = (ctx is None and not joining) or is_raised_on_every_rank(error)
        _report_user_error(error, rank, ctx if shared else None, quiet=shared and rank != 0)
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


def _quiet_warnings() -> None:
    """Ranks other than 0 log errors only: every warning they could print (the data, the flags, the checkpoint, this
    CPU) rank 0 prints too, and N copies bury it."""
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


def _report_user_error(error: UserError, rank: int, ctx: DistributedContext | None, *, quiet: bool) -> None:
    """Print ``error`` unless ``quiet``; with a shared error (``ctx`` given) the other ranks leave after rank 0."""
    if not quiet:
        print_error(error)
    if ctx is not None and ctx.is_distributed:
        try:
            barrier(ctx)  # rank 0 has printed
        except (RuntimeError, torch.distributed.DistError):
            pass  # a rank is gone already: nothing left to wait for
    if quiet:
        time.sleep(QUIET_EXIT_DELAY_S if ctx is not None else QUIET_EXIT_BEFORE_JOINING_S)


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
