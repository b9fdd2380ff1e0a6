"""A mixed cluster on one machine: the 4 ranks of the joint-planner bench posing as 2 nodes of 2, each
node pinned to a CPU core of its own (cgroup v1 cpuset), the second node slowed by a CPU quota (cgroup v1
cpu.cfs_quota_us) so that it stands in for an older kind of GPU node.

Layouts (what `setup` gives each node):
    fast   both nodes at a full core: the fast node type, for its per-node unit profile
    slow   both nodes at the quota: the slow node type, for its profile
    mixed  node 0 fast, node 1 slow: the cluster the configurations run on

Ranks join their node's cgroups themselves: torchrun starts this file as each rank's entry point
(`shim_args`), it writes its pid into the cgroups of node RANK // ranks-per-node, then runs the real
script as __main__. Every thread the rank starts afterwards (torch, gloo) inherits the placement.
Needs root and cgroup v1 cpu + cpuset controllers.
"""
from __future__ import annotations

import os
import runpy
import sys

CPUSET = "/sys/fs/cgroup/cpuset"
CPU = "/sys/fs/cgroup/cpu"
PREFIX = "amspb_node"
PERIOD_US = 10_000  # short periods: the quota throttles in small slices, not 50 ms bursts


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _node_dirs(node: int) -> tuple[str, str]:
    return os.path.join(CPUSET, f"{PREFIX}{node}"), os.path.join(CPU, f"{PREFIX}{node}")


def setup(layout: str, quota: float, nodes: int = 2) -> None:
    """Create (or reset) each node's cgroups for `layout`; `quota`: the slow node's share of one core."""
    if layout not in ("fast", "slow", "mixed"):
        raise ValueError(f"layout {layout!r} is not fast, slow or mixed")
    if not 0 < quota < 1:
        raise ValueError(f"quota {quota} must be a fraction of one core in (0, 1)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < nodes:
        raise SystemExit(f"{nodes} emulated nodes need a core each; this process may use {len(cpus)}")
    mems = open(os.path.join(CPUSET, "cpuset.mems")).read().strip()
    for node in range(nodes):
        cs, cpu = _node_dirs(node)
        os.makedirs(cs, exist_ok=True)
        os.makedirs(cpu, exist_ok=True)
        _write(os.path.join(cs, "cpuset.mems"), mems)
        _write(os.path.join(cs, "cpuset.cpus"), cpus[node])
        slow = layout == "slow" or (layout == "mixed" and node == nodes - 1)
        _write(os.path.join(cpu, "cpu.cfs_period_us"), PERIOD_US)
        _write(os.path.join(cpu, "cpu.cfs_quota_us"), int(quota * PERIOD_US) if slow else -1)


def teardown(nodes: int = 2) -> None:
    """Remove the node cgroups (their ranks have exited; a leftover process is moved to the root)."""
    for node in range(nodes):
        for d, root in zip(_node_dirs(node), (CPUSET, CPU)):
            if not os.path.isdir(d):
                continue
            for pid in open(os.path.join(d, "cgroup.procs")).read().split():
                try:
                    _write(os.path.join(root, "cgroup.procs"), pid)
                except OSError:
                    pass  # exited meanwhile
            os.rmdir(d)


def shim_args(script: str, ranks_per_node: int) -> list[str]:
    """What torchrun is given in place of `script`: this file, which places the rank, then runs it."""
    return [os.path.abspath(__file__), "--ranks-per-node", str(ranks_per_node), script]


def _join_and_run(argv: list[str]) -> None:
    rpn, script, args = int(argv[1]), argv[2], argv[3:]
    node = int(os.environ["RANK"]) // rpn
    for d in _node_dirs(node):
        _write(os.path.join(d, "cgroup.procs"), os.getpid())
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "--ranks-per-node":
        raise SystemExit("usage (as torchrun's entry point): slow_node.py --ranks-per-node R SCRIPT [ARGS...]")
    del sys.argv[1]
    _join_and_run(sys.argv)
