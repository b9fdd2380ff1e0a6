"""The joint planner: tensor / pipeline / data parallel degrees, the layer split, the micro-batch size
and, per pipeline stage, recomputation and the AMSP P/G/OS degrees of the stage's data-parallel group,
on clusters whose nodes may differ (GPU type, memory, links). docs/joint_planner.md has the model."""
from .search import JointPlan, plan_joint  # noqa: F401
