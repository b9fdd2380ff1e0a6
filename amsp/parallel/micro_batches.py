"""What the pipeline schedules need of a step's micro-batch count and of the stages per rank, without torch
(configs/validate.py checks both before a run starts, the runner again for callers that bypass it): the joint planner
(amsp/planner/joint/search.py) leaves out layouts a schedule refuses, and train.py refuses them before
anything is built (amsp/parallel/pipeline.check_micro_batches). Importing the pipeline runtime for this
rule cost the planner 1.6 s of torch import."""
from __future__ import annotations

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zero_bubble")  # parallel.schedule (amsp/parallel/pipeline.py)


def virtual_stages_problem(schedule: str, virtual_stages: int) -> str | None:
    """Why `schedule` cannot run `virtual_stages` stages per pipeline rank, or None when it can."""
    if schedule == "interleaved" and virtual_stages < 2 or schedule in ("1f1b", "gpipe") and virtual_stages != 1:
        return (f"parallel.virtual_stages={virtual_stages} is not allowed with parallel.schedule={schedule}: the "
                f"interleaved schedule needs virtual stages (>= 2), zero_bubble takes any, the others one")
    return None


def micro_batch_problem(schedule: str, num_micro: int, pp: int) -> str | None:
    """Why `schedule` cannot run `num_micro` micro-batches a step over `pp` stages, or None when it can."""
    if schedule != "gpipe" and num_micro < pp:
        return (f"parallel.schedule={schedule} needs at least parallel.pp={pp} micro-batches per step, got "
                f"{num_micro}: lower trainer.micro_batch_size or raise trainer.global_batch_size")
    if schedule == "interleaved" and num_micro % pp:
        return (f"the interleaved schedule needs the micro-batches per step ({num_micro}) to be a multiple of "
                f"parallel.pp={pp}; change trainer.global_batch_size or micro_batch_size")
    if schedule == "zero_bubble" and num_micro % max(1, num_micro // pp):
        rounds = max(1, num_micro // pp)
        return (f"the zero_bubble schedule runs the micro-batches in rounds of parallel.pp={pp} and needs their "
                f"count per step ({num_micro}) to be a multiple of the rounds ({rounds}); change "
                f"trainer.global_batch_size or micro_batch_size")
    return None
