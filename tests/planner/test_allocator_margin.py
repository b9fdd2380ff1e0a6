"""The allocator margin the planners fit plans with: set by amsp.planner.memory_margin, else the run's
allocator's (amsp/planner/allocator.py), and reported with its source."""
from __future__ import annotations

import dataclasses

import pytest

from amsp.plan import make_plan
from amsp.planner.allocator import (PAGE_TABLE_FRACTION, allocator_margin, describe_margin,
                                   glibc_returns_freed_blocks, margin_for)
from amsp.planner.cost_model import CostModel, Options
from tests.planner.planner_cases import flat_cluster, workload

RETURNING = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@pytest.mark.parametrize("env, returns", [
    (RETURNING, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"}, True),
    ({}, False),  # glibc's defaults: a dynamic threshold, freed heap blocks kept
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, False),  # no trim threshold: freed heap tops stay
    ({"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": "0"}, False),  # 4 MiB blocks on the heap
    ({"MALLOC_MMAP_THRESHOLD_": "lots", "MALLOC_TRIM_THRESHOLD_": "0"}, False),
])
def test_glibc_settings_that_return_freed_blocks(env, returns):
    assert glibc_returns_freed_blocks(env) is returns
    # on the CPU the tensors' page tables come on top of what the allocator keeps
    assert allocator_margin("cpu", env)[0] == pytest.approx((0.0 if returns else 0.08) + 1 / 512)


def test_cuda_keeps_the_caching_allocators_margin_whatever_glibc_does():
    assert allocator_margin("cuda", RETURNING)[0] == 0.08


def test_a_configured_margin_wins_and_the_report_names_the_source():
    assert margin_for(0.2, "cpu", RETURNING) == 0.2
    assert margin_for(None, "cpu", RETURNING) == PAGE_TABLE_FRACTION
    assert "amsp.planner.memory_margin" in describe_margin(0.2, "cuda")
    line = describe_margin(None, "cpu", RETURNING)
    assert "0.2%" in line and "glibc" in line and "page tables" in line
    assert "caching allocator" in describe_margin(None, "cuda")


def test_the_cost_model_fits_plans_with_the_allocators_margin(monkeypatch):
    """Options.memory_margin None: the cluster device's allocator in this process's environment."""
    w = workload("tiny")
    plan = make_plan("zero3", 8, 8)
    for key, value in RETURNING.items():
        monkeypatch.setenv(key, value)
    cpu = CostModel(w, flat_cluster(1, 8), Options(reserved_bytes=0)).evaluate(plan).memory
    assert cpu["reserved"] == pytest.approx(sum(v for k, v in cpu.items() if k != "reserved") / 512)
    cuda = CostModel(w, dataclasses.replace(flat_cluster(1, 8), device="cuda"), Options(reserved_bytes=0))
    m = cuda.evaluate(plan).memory
    assert m["reserved"] == pytest.approx(0.08 * sum(v for k, v in m.items() if k != "reserved"))
