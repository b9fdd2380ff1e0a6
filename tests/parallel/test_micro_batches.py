"""What each pipeline schedule needs of a step's micro-batch count (amsp/parallel/micro_batches.py), checked
against torch's own schedules where they refuse: train.py stops before building anything instead."""
from __future__ import annotations

import pytest

from amsp.errors import InputError
from amsp.parallel.micro_batches import micro_batch_problem
from amsp.parallel.pipeline import check_micro_batches


@pytest.mark.parametrize("schedule, num_micro, pp, words", [
    ("1f1b", 1, 2, "needs at least parallel.pp=2"),
    ("zero_bubble", 1, 2, "needs at least parallel.pp=2"),
    ("interleaved", 6, 4, "multiple of parallel.pp=4"),
    # torch's ScheduleInterleavedZeroBubble: rounds of max(1, n // pp), n a multiple of the rounds
    ("zero_bubble", 5, 2, "multiple of the rounds (2)"),
    ("zero_bubble", 10, 3, "multiple of the rounds (3)"),
])
def test_refused_counts_name_the_rule(schedule, num_micro, pp, words):
    assert words in micro_batch_problem(schedule, num_micro, pp)
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_micro_batches(schedule, num_micro, pp)


@pytest.mark.parametrize("schedule, num_micro, pp", [
    ("gpipe", 1, 4), ("1f1b", 3, 2), ("interleaved", 8, 4),
    ("zero_bubble", 4, 2), ("zero_bubble", 6, 4), ("zero_bubble", 9, 3), ("zero_bubble", 3, 2),
])
def test_accepted_counts(schedule, num_micro, pp):
    assert micro_batch_problem(schedule, num_micro, pp) is None


def test_torch_refuses_what_the_rule_refuses():
    """The rule's zero-bubble arithmetic is torch's: its constructor raises for 5 micro-batches over 2
    stages (built on fake stages: only the round check runs before the schedule needs a process group)."""
    pytest.importorskip("torch.distributed.pipelining")
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    import torch

    class FakeStage:
        group_size, group_rank, stage_index, num_stages, is_first, is_last = 2, 0, 0, 4, True, False
        submod = torch.nn.Linear(1, 1)

    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        ScheduleInterleavedZeroBubble([FakeStage(), FakeStage()], 5)
