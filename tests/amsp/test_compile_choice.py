"""model.compile=auto on CUDA is settled by measurement (amsp/compile_choice.py): compiled blocks only
where one compiled block's forward + backward is at least MIN_GAIN faster than the eager one. The
measurement itself runs here on CPU (a tiny block: the same code path as on CUDA, a few seconds of
inductor); the CUDA routing is checked with the measurement replaced, since no CUDA is touched."""
from __future__ import annotations

import json

import pytest
import torch

import amsp.compile_choice as cc
from amsp.compile_choice import CompileChoice, compiled_wins, measure_choice, resolve_auto_compile
from amsp.launch import DistEnv
from amsp.planner.__main__ import compose_config
from configs.schema import to_llama_config

SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
CUDA = torch.device("cuda", 0)  # a device object only: nothing below allocates on it


def test_compiled_blocks_are_kept_only_when_measurably_faster():
    assert compiled_wins(1.0, 0.96)
    assert compiled_wins(1.0, 1.0 - cc.MIN_GAIN)
    assert not compiled_wins(1.0, 0.99)  # a tie within noise: eager (no startup compile, no recompiles)
    assert not compiled_wins(1.0, 1.2)
    assert CompileChoice(0.010, 0.008, "x").compile and not CompileChoice(0.010, 0.0099, "x").compile


def _cfg(*over):
    return compose_config(["model=debug", "data.seq_len=64", *over])


def _measured(monkeypatch, eager_s, compiled_s):
    calls = []

    def fake(*a, **k):
        calls.append(a)
        return CompileChoice(eager_s, compiled_s, "measured on a stand-in")
    monkeypatch.setattr(cc, "measure_choice", fake)
    return calls


def test_auto_on_cuda_compiles_only_what_was_measured_faster(monkeypatch):
    calls = _measured(monkeypatch, 0.010, 0.0101)
    assert resolve_auto_compile(_cfg(), SINGLE, CUDA).model.compile == "off"
    assert len(calls) == 1
    _measured(monkeypatch, 0.010, 0.008)
    # "on" keeps auto: compiled without model parallelism, eager if the joint planner picks tp or pp > 1
    assert resolve_auto_compile(_cfg(), SINGLE, CUDA).model.compile == "auto"


def test_nothing_is_measured_where_auto_is_already_decided(monkeypatch):
    def never(*a, **k):
        raise AssertionError("measured")
    monkeypatch.setattr(cc, "measure_choice", never)
    assert resolve_auto_compile(_cfg(), SINGLE, "cpu").model.compile == "auto"  # off on CPU (resolve_compile)
    assert resolve_auto_compile(_cfg("model.compile=on"), SINGLE, CUDA).model.compile == "on"
    assert resolve_auto_compile(_cfg("model.compile=off"), SINGLE, CUDA).model.compile == "off"
    assert resolve_auto_compile(_cfg("parallel.tp=2"), SINGLE, CUDA).model.compile == "auto"  # build.py: off


# Slow (the suite's time budget): the decision from the measured times runs in the default run
# (test_compiled_blocks_are_kept_only_when_measurably_faster and the tests above).
@pytest.mark.slow
def test_measured_on_this_device_then_read_from_the_cache(tmp_path, monkeypatch, caplog):
    import torch._dynamo

    m = to_llama_config(_cfg("model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.fused=off").model)
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="amsp.compile_choice"):
        first = measure_choice(m, 32, 2, "fp32", "cpu", tmp_path)
    assert first.eager_s > 0 and first.compiled_s > 0 and first.source.startswith("measured on ")
    assert "eager and compiled" in caplog.text
    (path,) = tmp_path.glob("compile-choice-*.json")
    assert json.loads(path.read_text())["choice"]["eager_s"] == first.eager_s

    def never(*a, **k):
        raise AssertionError("timed again")
    monkeypatch.setattr(cc, "block_step_seconds", never)
    again = measure_choice(m, 32, 2, "fp32", "cpu", tmp_path)
    assert (again.eager_s, again.compiled_s) == (first.eager_s, first.compiled_s)
    assert again.source.startswith(f"cache {path}")
    with pytest.raises(AssertionError, match="timed again"):  # caching off: measured afresh
        measure_choice(m, 32, 2, "fp32", "cpu", tmp_path, use_cache=False)

    path.write_text(json.dumps({"choice": {"eager_s": -1, "compiled_s": 0.1, "source": "x"}}))
    monkeypatch.setattr(cc, "block_step_seconds", lambda *a, **k: 0.5)
    with caplog.at_level("WARNING", logger="amsp.compile_choice"):
        redone = measure_choice(m, 32, 2, "fp32", "cpu", tmp_path)
    assert "unusable" in caplog.text and redone.eager_s == 0.5 and not redone.compile


def test_a_block_that_does_not_compile_runs_eagerly_said_so_and_is_tried_again_next_start(tmp_path, monkeypatch,
                                                                                           caplog):
    def timing(*a, compiled, **k):
        if compiled:
            raise RuntimeError("triton not found\nmore detail")
        return 0.02
    monkeypatch.setattr(cc, "block_step_seconds", timing)
    m = to_llama_config(_cfg().model)
    with caplog.at_level("WARNING", logger="amsp.compile_choice"):
        choice = measure_choice(m, 32, 2, "fp32", "cpu", tmp_path)
    assert not choice.compile and choice.failure == "RuntimeError"
    assert "compiling one block failed, so the blocks run eagerly: RuntimeError: triton not found" in caplog.text
    assert "compiling one block failed (RuntimeError): eager blocks" in choice.describe()
    assert not list(tmp_path.glob("compile-choice-*.json"))  # not cached: the next start tries again


def test_a_sequence_longer_than_the_rotary_tables_is_refused_by_name(tmp_path):
    """The GPU check's first run of the CUDA test asked for seq 512 of the debug model (256 positions) and
    failed deep in the rope kernel; the measurement now says what is wrong before building anything."""
    m = to_llama_config(_cfg("model.dim=64", "model.n_heads=4", "model.n_kv_heads=2").model)
    with pytest.raises(ValueError, match=r"sequence length 512 exceeds model.max_seq_len=256"):
        measure_choice(m, 512, 1, "fp32", "cpu", tmp_path, use_cache=False)
