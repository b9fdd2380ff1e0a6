"""A hand-named pipeline whose n_layers pp does not divide, or with an explicit uneven parallel.layer_split,
runs (amsp.parallel.pipeline.split_layers splits it): the planner prices the split the pipeline builds
instead of refusing it (a ValueError that crashed train.py's amsp.plan=auto with tracebacks and exit 1),
and an input the planner refuses at startup is one InputError on every rank (exit status 2)."""
from __future__ import annotations

import dataclasses

import pytest

from amsp.errors import InputError
from amsp.planner import startup
from amsp.planner.workload import pipeline_split

from tests.planner.planner_cases import workload


def test_pipeline_split_is_the_runtimes_split():
    """The planner prices the split the pipeline builds (split_layers takes its blocks from pipeline_split):
    the embedding and the head count as a layer each, an explicit split wins, a bad one is an input error."""
    from amsp.parallel.pipeline import split_layers

    assert pipeline_split(3, 2) == [2, 1] and pipeline_split(8, 4) == [2, 2, 3, 1]
    assert pipeline_split(32, 4) == [8, 8, 9, 7] and pipeline_split(5, 4, [2, 1, 1, 1]) == [2, 1, 1, 1]
    for n_layers in range(1, 13):
        for stages in range(1, n_layers + 1):
            assert pipeline_split(n_layers, stages) == [len(s) for s in split_layers(n_layers, stages)]
    assert split_layers(5, 4, [2, 1, 1, 1]) == [[0, 1], [2], [3], [4]]
    with pytest.raises(InputError, match="must give 2 stages"):
        split_layers(3, 2, [3, 1])


def test_uneven_pipeline_is_priced_as_its_largest_rank():
    w = workload(pp=2, model_overrides={"n_layers": 3})  # used to raise "pp=2 must divide n_layers=3"
    assert w.stage_layers() == [2, 1] and w.layers == 2
    # interleaved: pipeline rank r holds stages r and r + pp, so rank 0 holds 2 + 1 of [2, 1, 1, 1]
    w = dataclasses.replace(workload(pp=2, model_overrides={"n_layers": 5}), schedule="interleaved",
                            virtual_stages=2, layer_split=(2, 1, 1, 1))
    assert w.stage_layers() == [2, 1, 1, 1] and w.layers == 3
    # an explicit uneven split is what is priced, not n_layers // pp
    even = workload(pp=2, model_overrides={"n_layers": 4})
    uneven = dataclasses.replace(even, layer_split=(3, 1))
    assert (even.layers, uneven.layers) == (2, 3)
    assert uneven.params_per_rank() > even.params_per_rank()
    assert uneven.model_flops_per_step() > even.model_flops_per_step()


def test_split_the_runtime_refuses_is_a_value_error():
    with pytest.raises(ValueError, match="must give 2 stages"):
        dataclasses.replace(workload(pp=2, model_overrides={"n_layers": 4}), layer_split=(2, 1))
    with pytest.raises(ValueError, match="every stage needs a block"):
        workload(pp=4, model_overrides={"n_layers": 3})


def test_planner_cli_prices_an_uneven_pipeline(capsys):
    from amsp.planner.__main__ import main

    # it refused this with exit status 2 ("pp=2 must divide n_layers=3"); a world of 2 holds the pipeline
    assert main(["--json", "model=debug", "model.n_layers=3", "parallel.pp=2", "cluster.ranks_per_node=2"]) == 0


class _Denv:
    def __init__(self, rank):
        self.rank, self.world_size = rank, 2


def test_planner_value_error_is_an_input_error_on_every_rank(monkeypatch):
    """Rank 0 raised the ValueError itself (a traceback, exit 1) and the others a RuntimeError."""
    sent = []
    monkeypatch.setattr(startup.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(startup.control, "broadcast_object", lambda obj, src=0: sent.append(obj) or obj)

    def refuse():
        raise ValueError("pipeline degree refused")

    with pytest.raises(InputError, match="planner: pipeline degree refused"):
        startup._on_rank0(_Denv(0), refuse)
    monkeypatch.setattr(startup.control, "broadcast_object", lambda obj, src=0: sent[0])
    with pytest.raises(InputError, match="planner: pipeline degree refused"):
        startup._on_rank0(_Denv(1), refuse)
