"""An emulated multi-node cluster on one machine: network namespaces as nodes, rate-limited links.

Layout (everything lives in namespaces this module creates; the host's own network is untouched):

    <tag>-sw   a "switch" namespace holding bridge br0 and the switch ends v0..v{K-1} of the links
    <tag>-n{i} node i: loopback + eth0 (10.231.0.{i+1}/24), the node end of link i

Each link is a veth pair shaped in both directions with tc tbf (node uplink on eth0's egress,
downlink on v{i}'s egress), so a node's NIC is full duplex at `rate`. Ranks of one node run inside
its namespace (`ip netns exec`), with GLOO_SOCKET_IFNAME=eth0 and MASTER_ADDR = node 0's address:
traffic between ranks of the same node goes to the node's own address and stays on the namespace's
loopback path, so eth0's byte counters count exactly what crossed the node boundary.

Teardown runs on normal exit, on exceptions, on SIGINT/SIGTERM/SIGHUP (handlers raise so finally
blocks run) and from atexit; rank processes get PR_SET_PDEATHSIG so they die with the harness.
Every launch has a wall-clock timeout after which all its ranks are killed.

Needs root and iproute2 (`ip`, `tc`); `check_requirements()` says what is missing and
`install_requirements()` installs it with apt-get. CLI: `python scripts/bench/netns_cluster.py -h`.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

PREFIX = "amspb"  # every namespace this module creates starts with this, followed by the creator's pid
SUBNET = "10.231.0"  # private addresses, only ever assigned inside our own namespaces
NODE_IF = "eth0"
_LIVE: list["NetnsCluster"] = []
_HANDLERS_INSTALLED = False


class HarnessError(RuntimeError):
    pass


# ---------------------------------------------------------------- requirements

def check_requirements(need_delay: bool = False) -> list[str]:
    """Problems that stop the harness here (empty list = ready)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (network namespaces and tc need CAP_NET_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` not found: install iproute2 (apt-get install -y iproute2), "
                            f"or run with --install-deps")
    if need_delay and not problems and not netem_available():
        problems.append("the kernel has no netem qdisc (sch_netem), so link delay cannot be emulated; "
                        "run with delay 0 (rate limiting uses tbf, which is available)")
    return problems


def install_requirements() -> None:
    """Install iproute2 with apt-get (Debian/Ubuntu); raises with the command's output on failure."""
    if shutil.which("ip") and shutil.which("tc"):
        return
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "iproute2"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise HarnessError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def _sh(args: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise HarnessError(f"command failed ({r.returncode}): {' '.join(args)}\n{r.stderr.strip()}")
    return r


def netem_available() -> bool:
    """Probe for sch_netem in a throwaway namespace (the kernel on these machines lacks it)."""
    ns = f"{PREFIX}{os.getpid()}-probe"
    try:
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        return _sh(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
                   check=False).returncode == 0
    finally:
        _sh(["ip", "netns", "del", ns], check=False)


def our_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def cleanup_stale() -> list[str]:
    """Delete namespaces left by harness processes that no longer exist (never a live run's)."""
    removed = []
    for ns in our_namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _sh(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed


# ---------------------------------------------------------------- rate parsing

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(rate: str) -> float:
    """'200mbit' -> 2e8 bits/s (tc's units)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?bit)\s*", rate.lower())
    if not m:
        raise HarnessError(f"rate {rate!r} not understood; use e.g. 100mbit, 1gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


# ---------------------------------------------------------------- the cluster

@dataclass
class RankResult:
    rank: int
    node: int
    returncode: int | None
    log: str


@dataclass
class LaunchResult:
    ranks: list[RankResult]
    wall_s: float
    timed_out: bool
    link_bytes: dict[int, dict[str, int]] = field(default_factory=dict)  # node -> tx/rx delta

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def inter_node_bytes(self) -> int:
        """Bytes that left the nodes over their links (each byte crossing counted once, at the sender)."""
        return sum(v["tx_bytes"] for v in self.link_bytes.values())

    def failure_report(self, tail: int = 3000) -> str:
        bad = [r for r in self.ranks if r.returncode != 0] or self.ranks[:1]
        head = "timed out" if self.timed_out else "failed"
        return f"launch {head}:\n" + "\n".join(
            f"--- rank {r.rank} (node {r.node}, rc={r.returncode}) ---\n{r.log[-tail:]}" for r in bad)


class NetnsCluster:
    """K namespace nodes joined by a bridge over veth links shaped to `rate` (None = unshaped)."""

    def __init__(self, nodes: int, rate: str | None = None, delay_ms: float = 0.0, mtu: int = 1500):
        if nodes < 1 or nodes > 200:
            raise HarnessError(f"nodes={nodes}: choose 1..200")
        self.nodes, self.rate, self.delay_ms, self.mtu = nodes, rate, delay_ms, mtu
        self.rate_bps = parse_rate(rate) if rate else None
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # -- naming
    def node_ns(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    def node_addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # -- lifecycle
    def __enter__(self) -> "NetnsCluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        problems = check_requirements(need_delay=self.delay_ms > 0)
        if problems:
            raise HarnessError("emulated cluster cannot start: " + "; ".join(problems))
        _install_handlers()
        _LIVE.append(self)
        try:
            self._add_ns(self.switch)
            _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for i in range(self.nodes):
                ns = self.node_ns(i)
                self._add_ns(ns)
                _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
                # Create the pair in the switch namespace, then move the node end into the node.
                _sh(["ip", "-n", self.switch, "link", "add", f"v{i}", "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", f"t{i}", "mtu", str(self.mtu)])
                _sh(["ip", "-n", self.switch, "link", "set", f"t{i}", "netns", ns])
                _sh(["ip", "-n", ns, "link", "set", f"t{i}", "name", NODE_IF])
                _sh(["ip", "-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", NODE_IF])
                _sh(["ip", "-n", ns, "link", "set", NODE_IF, "up"])
                _sh(["ip", "-n", self.switch, "link", "set", f"v{i}", "master", "br0"])
                _sh(["ip", "-n", self.switch, "link", "set", f"v{i}", "up"])
                if self.rate_bps:
                    self._shape(ns, NODE_IF)  # uplink
                    self._shape(self.switch, f"v{i}")  # downlink
            self._up = True
            self._wait_reachable()
        except BaseException:
            self.down()
            raise

    def _add_ns(self, ns: str) -> None:
        _sh(["ip", "netns", "add", ns])
        self._created.append(ns)

    def _shape(self, ns: str, dev: str) -> None:
        rate = self.rate_bps
        # Bucket: >= 4 ms of traffic and >= two 64 KiB GSO super-packets, so tbf never drops
        # a whole segment train; queue bounded at 100 ms of traffic.
        burst = max(int(rate / 8 * 0.004), 131072)
        base = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "100ms"]
        _sh(base)
        if self.delay_ms > 0:
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                 "delay", f"{self.delay_ms}ms", "limit", "100000"])

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        if self.nodes < 2:
            return
        deadline = time.monotonic() + timeout
        for i in range(1, self.nodes):
            while True:
                r = _sh(["ip", "netns", "exec", self.node_ns(i), "ping", "-c", "1", "-W", "1", self.node_addr(0)],
                        check=False) if shutil.which("ping") else None
                if r is None or r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise HarnessError(f"node {i} cannot reach node 0 at {self.node_addr(0)}: {r.stdout}{r.stderr}")
                time.sleep(0.2)

    def down(self) -> None:
        """Kill our ranks, delete our namespaces (idempotent; safe from signal handlers and atexit)."""
        for p in self._procs:
            _kill_group(p)
        self._procs = []
        for ns in reversed(self._created):
            _sh(["ip", "netns", "del", ns], check=False)
        self._created = []
        self._up = False
        if self in _LIVE:
            _LIVE.remove(self)

    # -- counters
    def read_counters(self) -> dict[int, dict[str, int]]:
        """Per node: bytes sent (tx) and received (rx) on its link, from the interface's stats64."""
        out = {}
        for i in range(self.nodes):
            r = _sh(["ip", "-n", self.node_ns(i), "-j", "-s", "link", "show", NODE_IF])
            st = json.loads(r.stdout)[0]["stats64"]
            out[i] = {"tx_bytes": int(st["tx"]["bytes"]), "rx_bytes": int(st["rx"]["bytes"]),
                      "tx_dropped": int(st["tx"].get("dropped", 0))}
        return out

    @staticmethod
    def counter_delta(before: dict, after: dict) -> dict[int, dict[str, int]]:
        return {i: {k: after[i][k] - before[i][k] for k in after[i]} for i in after}

    # -- launching ranks
    def launch(self, argv: list[str], ranks_per_node: int, timeout_s: float, env: dict | None = None,
               threads_per_rank: int = 1, master_port: int = 29611, log_dir: str | None = None) -> LaunchResult:
        """Run `argv` as ranks_per_node ranks in every node; wait at most timeout_s, then kill all.

        Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (the
        torchrun contract that amsp.launch reads), GLOO_SOCKET_IFNAME and thread limits. Each rank's output
        is in the result; its file rank<N>.log stays in log_dir when one is given.
        """
        if not self._up:
            raise HarnessError("cluster is not up")
        world = self.nodes * ranks_per_node
        own_dir = log_dir is None  # the logs are returned in the result: a folder of our own is removed after
        log_dir = log_dir or tempfile.mkdtemp(prefix="amspb-logs-")
        ranks, logs = [], []
        before = self.read_counters()
        t0 = time.monotonic()
        try:
            for node in range(self.nodes):
                for local in range(ranks_per_node):
                    rank = node * ranks_per_node + local
                    renv = dict(os.environ)
                    renv.update(env or {})
                    renv.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                                 "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": self.node_addr(0),
                                 "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": NODE_IF,
                                 "OMP_NUM_THREADS": str(threads_per_rank),
                                 "MKL_NUM_THREADS": str(threads_per_rank), "AMSPB_NODE": str(node),
                                 # every emulated node is this one machine: its cores are shared by all
                                 "AMSP_MACHINE_RANKS": str(world)})
                    path = os.path.join(log_dir, f"rank{rank}.log")
                    fh = open(path, "w")
                    logs.append((rank, node, path))
                    p = subprocess.Popen(["ip", "netns", "exec", self.node_ns(node), *argv], env=renv,
                                         stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
                    fh.close()
                    self._procs.append(p)
                    ranks.append(p)
            timed_out = _wait_all(ranks, timeout_s)
        finally:
            for p in ranks:
                _kill_group(p)
            self._procs = [p for p in self._procs if p not in ranks]
        wall = time.monotonic() - t0
        after = self.read_counters()
        results = []
        for (rank, node, path), p in zip(logs, ranks):
            with open(path, errors="replace") as f:
                results.append(RankResult(rank, node, p.returncode, f.read()))
        if own_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
        return LaunchResult(results, wall, timed_out, self.counter_delta(before, after))


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for all; stop early when one fails (the others would hang in a collective)."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        if any(c not in (None, 0) for c in codes):
            time.sleep(2.0)  # let the others print their side of the failure
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ranks never outlive the harness


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank's own session (start_new_session=True)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _teardown_all() -> None:
    for c in list(_LIVE):
        c.down()


def _on_signal(signum, frame):
    _teardown_all()
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_teardown_all)
    import threading

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, _on_signal)
    _HANDLERS_INSTALLED = True


# ---------------------------------------------------------------- CLI

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def python_argv(script: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(HERE, script), *args]


def repo_env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": REPO + (os.pathsep + pp if pp else "")}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("allreduce", "run"):
        s = sub.add_parser(name)
        s.add_argument("--nodes", type=int, default=2)
        s.add_argument("--ranks-per-node", type=int, default=1)
        s.add_argument("--rate", default="200mbit", help="per-direction link rate (tc units), 'none' = unshaped")
        s.add_argument("--delay-ms", type=float, default=0.0, help="one-way link delay (needs sch_netem)")
        s.add_argument("--timeout", type=float, default=300.0)
        s.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    sub.choices["allreduce"].add_argument("--mb", type=float, default=32.0, help="tensor size in MB (fp32)")
    sub.choices["allreduce"].add_argument("--repeats", type=int, default=3)
    sub.choices["allreduce"].add_argument("--modes", default="flat,hierarchical")
    sub.choices["run"].add_argument("command", nargs=argparse.REMAINDER, help="-- command run by every rank")
    sub.add_parser("cleanup", help="delete namespaces left behind by dead harness processes")
    sub.add_parser("check", help="say what is missing to run the harness here")
    sub.add_parser("install-deps", help="apt-get install iproute2 if ip/tc are missing")
    a = ap.parse_args(argv)

    if a.cmd == "check":
        problems = check_requirements()
        print("ready" if not problems else "\n".join(problems))
        if not problems:
            print("netem (link delay):", "available" if netem_available() else "NOT available in this kernel")
        return 1 if problems else 0
    if a.cmd == "install-deps":
        install_requirements()
        return 0
    if a.cmd == "cleanup":
        print("removed:", cleanup_stale() or "nothing")
        return 0
    rate = None if a.rate == "none" else a.rate
    with NetnsCluster(a.nodes, rate=rate, delay_ms=a.delay_ms) as cl:
        if a.cmd == "run":
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            res = cl.launch(cmd, a.ranks_per_node, a.timeout, env=repo_env(), threads_per_rank=a.threads)
            for r in res.ranks:
                print(f"--- rank {r.rank} (node {r.node}) rc={r.returncode}\n{r.log[-4000:]}")
            print(json.dumps({"wall_s": round(res.wall_s, 3), "link_bytes": res.link_bytes}))
            return 0 if res.ok else 1
        out = tempfile.mktemp(prefix="amspb-allreduce-", suffix=".json")
        res = cl.launch(python_argv("collective_probe.py", "--mb", str(a.mb), "--repeats", str(a.repeats),
                                    "--modes", a.modes, "--out", out),
                        a.ranks_per_node, a.timeout, env=repo_env(), threads_per_rank=a.threads)
        if not res.ok:
            print(res.failure_report(), file=sys.stderr)
            return 1
        with open(out) as f:
            report = json.load(f)
        os.unlink(out)
        report.update({"nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "rate": a.rate,
                       "inter_node_bytes_total": res.inter_node_bytes()})
        print(json.dumps(report, indent=1))
        return 0


if __name__ == "__main__":
    sys.exit(main())
