"""The recheck of a joint plan (parallel.auto) compares the measured step with the joint planner's own
prediction (its winner's JointPlan.step_s), not the data-parallel cost model's price of one stage's
share (a -48.8% error and a communication x28 refit that cleared the caches); it refits and replans nothing."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from omegaconf import OmegaConf

import amsp.replan_switch as rs
from amsp.planner import replan as rp


def _replanner(tmp_path, joint_step_s=None):
    cfg = OmegaConf.create({"amsp": {"planner": {"recheck_steps": 20, "replan": True}}})
    denv = SimpleNamespace(rank=0, world_size=1)
    return rs.Replanner(cfg, denv, "cpu", None, "joint-plan", tmp_path, joint=True,
                          joint_step_s=joint_step_s)


def test_joint_recheck_compares_with_the_joint_table(tmp_path, monkeypatch, caplog):
    forgotten = []
    monkeypatch.setattr(rs, "_forget_stale_caches", lambda *a: forgotten.append(a) or (False, False))
    r = _replanner(tmp_path, joint_step_s=0.091)
    with caplog.at_level(logging.INFO, logger=rs.__name__):
        record = r._decide_or_raise(rp.Measured(step_s=0.1, exposed_comm_s=0.0, peak_bytes=0.0, steps=20))
    assert record["switch"] is False and record["new_plan_object"] is None
    assert record["predicted_joint_step_s"] == 0.091 and abs(record["step_time_error"] - (-0.09)) < 1e-9
    assert "refit" not in record and not forgotten  # no refit, no caches cleared
    line = [m for m in caplog.messages if "planner recheck" in m]
    assert len(line) == 1 and "joint planner's table predicted 0.0910 s (error -9.0%)" in line[0], line
    assert "no refit and no replan" in line[0]
    assert json.loads((tmp_path / "replan.json").read_text())[0]["joint"] is True


def test_joint_recheck_without_a_table_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=rs.__name__):
        record = _replanner(tmp_path)._decide_or_raise(rp.Measured(0.1, 0.0, 0.0, 20))
    assert record["predicted_joint_step_s"] is None and record["switch"] is False
    assert any("predicted n/a" in m for m in caplog.messages)
