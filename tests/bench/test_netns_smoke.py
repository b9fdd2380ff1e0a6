"""Smoke test of the emulated-cluster harness: 2 namespace nodes x 1 rank, one small all_reduce.

Checks that the ranks ran inside the nodes, that the link counters saw the inter-node traffic,
and that teardown left no namespace behind. Needs root and iproute2; skipped otherwise.
"""
import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("netns_cluster", os.path.join(ROOT, "scripts", "bench", "netns_cluster.py"))
nc = importlib.util.module_from_spec(_spec)
sys.modules["netns_cluster"] = nc  # dataclasses look their module up here
_spec.loader.exec_module(nc)

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                reason="needs root and iproute2 (ip, tc)")

RANK_PROGRAM = r"""
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
x = torch.full((1 << 20,), float(dist.get_rank() + 1))  # 4 MB
dist.all_reduce(x)
assert x[0].item() == 3.0, x[0].item()
print("OK", os.environ["AMSPB_NODE"], open("/sys/class/net/eth0/address").read().strip(), flush=True)
dist.destroy_process_group()
"""


def test_two_nodes_allreduce_counts_link_bytes_and_tears_down():
    with nc.NetnsCluster(2, rate="1gbit") as cl:
        names = [cl.switch, cl.node_ns(0), cl.node_ns(1)]
        assert all(n in nc.our_namespaces() for n in names)
        res = cl.launch([sys.executable, "-c", RANK_PROGRAM], ranks_per_node=1, timeout_s=25)
        assert res.ok, res.failure_report()
        macs = {r.log.split()[-1] for r in res.ranks}
        assert len(macs) == 2, "each rank must see its own node's eth0"
        for node in (0, 1):
            # a ring all-reduce of 4 MB over 2 ranks sends >= 4 MB out of each node
            assert res.link_bytes[node]["tx_bytes"] >= 4 << 20, res.link_bytes
            assert res.link_bytes[node]["rx_bytes"] >= 4 << 20, res.link_bytes
    left = set(nc.our_namespaces()) & set(names)
    assert not left, f"teardown left namespaces: {left}"


def test_intra_node_traffic_stays_off_the_link():
    with nc.NetnsCluster(1, rate="100mbit") as cl:
        res = cl.launch([sys.executable, "-c", RANK_PROGRAM],
                        ranks_per_node=2, timeout_s=25)
        assert res.ok, res.failure_report()
        assert res.link_bytes[0]["tx_bytes"] < 64 << 10, res.link_bytes  # 4 MB went over loopback
