"""The metrics line's byte count is the AMSP engine's data-parallel traffic: labelled so, and a tp/pp > 1 run
told once that its TP collectives and pipeline sends are not in it (a TP=2 run logged `comm/step intra 4 B`)."""
import torch

from amsp.metrics import MetricsLogger, Peak
from amsp.metrics.logger import model_parallel_comm_note


def test_console_line_names_the_count_data_parallel(tmp_path):
    m = MetricsLogger(tmp_path, rank=0, world_size=1, total_steps=10, tokens_per_step=1000, flops_per_token=1e6,
                      device=torch.device("cpu"), peak=Peak(1e10, "test"))
    m.record_step({"step": 0.5}, comm={"bytes_intra_node": 4.0, "bytes_inter_node": 0.0, "exposed_s": 0.0})
    rec = m.log(1, loss=2.0, lr=1e-3, grad_norm=1.0)
    line = m.console_line(rec)
    assert "| dp comm/step intra 4 B inter 0 B |" in line, line
    assert rec["comm_bytes_intra_node"] == 4.0  # metrics.jsonl keeps its field names


def test_model_parallel_runs_are_told_what_the_count_leaves_out():
    assert model_parallel_comm_note(1, 1) is None
    tp = model_parallel_comm_note(2, 1)
    assert "data-parallel traffic only" in tp and "tensor-parallel collectives (tp 2, pp 1)" in tp
    assert "pipeline" not in tp
    both = model_parallel_comm_note(2, 2)
    assert "tensor-parallel collectives and pipeline sends (tp 2, pp 2) are not in it" in both
    assert "tensor-parallel" not in model_parallel_comm_note(1, 2)
