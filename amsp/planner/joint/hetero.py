"""A cluster of node groups that may differ: per group a preset of configs/cluster/ (GPU peak, memory,
links inside a node) and a node count; between groups an optional bandwidth table.

YAML (configs/clusters_mixed/mixed_a100_v100.yaml):
    name: mixed_a100_v100
    node_groups:
      - {preset: a100x8, nodes: 2}
      - {preset: v100x8, nodes: 2}
    inter_group_gbs: {a100x8-v100x8: 12.5}   # per node, GB/s; default: the slower group's inter-node figure

A group may carry a `name` of its own (default: its preset's), so two kinds of node described by the
same preset stay apart, e.g. {name: slow, preset: cpu, nodes: 1}: what tells them apart is then what
each measures at training startup (parallel.cluster_file, amsp/parallel/mixed_cluster.py).

Ranks are numbered node group by node group, node by node, as a launcher given the hosts in that order
would number them; the mesh (amsp/parallel/mesh.py) then puts pipeline stage i on ranks
[i*tp*dp, (i+1)*tp*dp), so a stage lands on the node groups those ranks live on.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field

from amsp.errors import InputError

from ..cluster import ClusterSpec, cluster_from_config
from ..device_preset import preset_path

CLUSTER_DIR = pathlib.Path(__file__).resolve().parents[3] / "configs" / "cluster"


@dataclass(frozen=True)
class NodeGroup:
    name: str  # the group's name: its preset's (e.g. a100x8) unless the file names it
    nodes: int
    spec: ClusterSpec  # the preset, shaped as this group (nodes x ranks_per_node)
    preset: str = ""  # the configs/cluster/ preset it was built from ("" : the same as name)

    @property
    def gpus(self) -> int:
        return self.nodes * self.spec.ranks_per_node


@dataclass(frozen=True)
class HeteroCluster:
    name: str
    groups: tuple[NodeGroup, ...]
    inter_group_gbs: dict = field(default_factory=dict)  # "a-b" -> GB/s per node

    def __post_init__(self) -> None:
        if not self.groups:
            raise InputError(f"cluster {self.name}: no node groups")
        per_node = {g.spec.ranks_per_node for g in self.groups}
        if len(per_node) != 1:
            raise InputError(f"cluster {self.name}: node groups with different GPUs per node {sorted(per_node)}; "
                             f"the mesh's rank order needs one ranks-per-node figure")
        presets: dict = {}
        for g in self.groups:
            if presets.setdefault(g.name, g.preset or g.name) != (g.preset or g.name):
                raise InputError(f"cluster {self.name}: node groups named {g.name!r} use different presets "
                                 f"({presets[g.name]}, {g.preset}); give each kind of node its own name")
        pairs = {f"{a}-{b}" for a in presets for b in presets if a != b}
        unknown = sorted(set(map(str, self.inter_group_gbs)) - pairs)
        if unknown:
            raise InputError(f"cluster {self.name}: inter_group_gbs names {', '.join(unknown)}, not a pair of its "
                             f"node groups ({', '.join(sorted(pairs)) or 'one group: no pairs'})")
        for key, gbs in self.inter_group_gbs.items():  # a time divides by it
            if not _positive_number(gbs):
                raise InputError(f"cluster {self.name}: inter_group_gbs.{key}={gbs!r}; a bandwidth is a number of "
                                 f"GB/s per node > 0")

    @property
    def ranks_per_node(self) -> int:
        return self.groups[0].spec.ranks_per_node

    @property
    def world(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def homogeneous(self) -> bool:
        return len({g.name for g in self.groups}) == 1

    def group_of_rank(self, rank: int) -> NodeGroup:
        for g in self.groups:
            if rank < g.gpus:
                return g
            rank -= g.gpus
        raise ValueError(f"rank outside a cluster of {self.world}")

    def group_names_by_rank(self) -> list[str]:
        """The node group's name of every rank, in rank order."""
        return [g.name for g in self.groups for _ in range(g.gpus)]

    def groups_of_ranks(self, lo: int, hi: int) -> list[NodeGroup]:
        """The node groups ranks [lo, hi) live on (a pipeline stage spanning two kinds of node)."""
        out, start = [], 0
        for g in self.groups:
            end = start + g.gpus
            if start < hi and lo < end:
                out.append(g)
            start = end
        return out

    def link_gbs(self, a: NodeGroup, b: NodeGroup) -> float:
        """Per-node bandwidth between two node groups (inter-node figure of the slower side by default)."""
        if a.name == b.name:
            return a.spec.fallback["inter"].gbps
        for key in (f"{a.name}-{b.name}", f"{b.name}-{a.name}"):
            if key in self.inter_group_gbs:
                return float(self.inter_group_gbs[key])
        return min(a.spec.fallback["inter"].gbps, b.spec.fallback["inter"].gbps)

    def describe(self) -> str:
        parts = [f"{g.nodes} x {g.name} ({g.spec.ranks_per_node} GPUs, {g.spec.device_memory_bytes / 2**30:.3g} GiB, "
                 f"{g.spec.peak_flops / 1e12:.3g} TFLOP/s)" for g in self.groups]
        return f"cluster {self.name}: " + " + ".join(parts) + f" = {self.world} GPUs"


def load_preset(name: str, nodes: int) -> ClusterSpec:
    """A configs/cluster/<name>.yaml preset (or a single node type's file, preset_path) as a ClusterSpec
    of `nodes` nodes."""
    from omegaconf import OmegaConf

    from configs.schema import ClusterConfig

    path = preset_path(name)
    if not path.is_file():
        have = sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))
        raise InputError(f"no cluster preset {name!r} in {CLUSTER_DIR} (have: {', '.join(have)})")
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    if "node_groups" in raw:
        raise InputError(f"{path} is a mixed cluster; a node group names a single-node-type preset")
    node = OmegaConf.merge(OmegaConf.structured(ClusterConfig), raw)
    return cluster_from_config(node, nodes=nodes)


def from_spec(spec: ClusterSpec) -> HeteroCluster:
    """A homogeneous cluster (the planner's usual ClusterSpec) as one node group."""
    return HeteroCluster(spec.name, (NodeGroup(spec.name, spec.nodes, spec),))


def _positive_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _whole_at_least_one(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


_GROUP_KEYS = ("name", "preset", "nodes")
_MIXED_KEYS = ("name", "node_groups", "inter_group_gbs")


def _check_preset_keys(path: pathlib.Path, raw: dict) -> None:
    """A file without node_groups is read as one node type's preset (configs/cluster/): refused when a key
    is neither (a misspelt `node_group:`) or when it has no figures of a node at all (an empty file)."""
    from configs.schema import ClusterConfig

    fields = [f.name for f in dataclasses.fields(ClusterConfig)]
    unknown = sorted(set(map(str, raw)) - set(fields) - {"defaults"})
    if unknown:
        raise InputError(f"{path}: unknown key(s) {', '.join(unknown)}; a cluster file has node_groups (a mixed "
                         f"cluster: {', '.join(_MIXED_KEYS)}) or a single node type's preset fields "
                         f"({', '.join(fields)})")
    if not set(raw) - {"name", "nodes", "defaults"}:
        raise InputError(f"{path}: neither node_groups nor a node type's figures (peak_tflops, "
                         f"device_memory_gib, ...: the fields of a configs/cluster/ preset)")


def read_cluster_file(path: str | pathlib.Path) -> tuple[str, list[tuple[str, str, int]], dict]:
    """(name, [(group name, preset, nodes)], inter_group_gbs) of a mixed-cluster YAML, or of a plain preset
    file as one group whose preset is the file's own path (preset_path); InputError naming the file and
    the key when it is malformed."""
    from omegaconf import OmegaConf

    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"cluster file {path} does not exist")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # a YAML syntax error: name the file
        raise InputError(f"cluster file {path}: not readable as YAML ({e})") from e
    if not isinstance(raw, dict):
        raise InputError(f"cluster file {path}: expected a mapping with node_groups, got {type(raw).__name__}")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise InputError(f"{path}: name={name!r}; the cluster's name is a non-empty string")
    if "node_groups" not in raw:  # a plain preset: one group of its own nodes, priced from this file
        nodes = raw.get("nodes", 1)
        if not _whole_at_least_one(nodes):
            raise InputError(f"{path}: nodes={nodes!r}; a cluster has a whole number of nodes >= 1")
        _check_preset_keys(path, raw)
        return name, [(name, str(path.resolve()), nodes)], {}
    unknown = sorted(set(map(str, raw)) - set(_MIXED_KEYS))
    if unknown:
        raise InputError(f"{path}: unknown key(s) {', '.join(unknown)}; a mixed cluster has {', '.join(_MIXED_KEYS)}")
    entries = raw["node_groups"]
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{path}: node_groups is empty or not a list of {{preset, nodes[, name]}} entries, got "
                         f"{entries!r}")
    groups = []
    for i, g in enumerate(entries):
        if not isinstance(g, dict) or "preset" not in g or "nodes" not in g:
            raise InputError(f"{path}: node_groups[{i}] needs `preset` and `nodes`, got {g}")
        extra = sorted(set(map(str, g)) - set(_GROUP_KEYS))
        if extra:
            raise InputError(f"{path}: node_groups[{i}] has unknown key(s) {', '.join(extra)}; a group has "
                             f"{', '.join(_GROUP_KEYS)}")
        if not _whole_at_least_one(g["nodes"]):
            raise InputError(f"{path}: node_groups[{i}].nodes={g['nodes']!r}; a group has a whole number >= 1 of "
                             f"nodes")
        for key in ("preset", "name"):
            if key in g and g[key] is not None and (not isinstance(g[key], str) or not g[key]):
                raise InputError(f"{path}: node_groups[{i}].{key}={g[key]!r}; it is a non-empty string")
        groups.append((g.get("name") or g["preset"], g["preset"], g["nodes"]))
    inter = raw.get("inter_group_gbs") or {}
    if not isinstance(inter, dict):
        raise InputError(f"{path}: inter_group_gbs={inter!r}; it maps `<group>-<group>` to GB/s per node, e.g. "
                         f"{{a100x8-v100x8: 25}}")
    for key, gbs in inter.items():
        if not _positive_number(gbs):
            raise InputError(f"{path}: inter_group_gbs.{key}={gbs!r}; a bandwidth is a number of GB/s per node > 0")
    return name, groups, {str(k): v for k, v in inter.items()}


def load_hetero(path: str | pathlib.Path, resolve=load_preset) -> HeteroCluster:
    """A mixed-cluster YAML (see the module docstring), or a single node type's cluster file (a
    configs/cluster/ preset's fields) as one node group priced from that file's own figures.
    resolve(preset, nodes) -> ClusterSpec builds each group's spec (training startup resolves a preset as
    `cluster=<preset>` would: measured CPU figures, the device's real memory)."""
    name, groups, inter = read_cluster_file(path)
    return HeteroCluster(name, tuple(NodeGroup(g, nodes, resolve(preset, nodes), preset)
                                     for g, preset, nodes in groups), inter)


def read_efficiency_file(path: str | pathlib.Path, cluster: HeteroCluster) -> dict:
    """{node group: fraction of peak its compute reaches} from a JSON file (the planner's --efficiency);
    InputError naming the file and the key for anything else: not a JSON object, a key that names no node
    group of `cluster` (silently unused otherwise), a value that is not a number in (0, 1]."""
    path = pathlib.Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--efficiency {path}: not readable as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise InputError(f"--efficiency {path}: expected a JSON object of node group -> fraction of peak, got "
                         f"{type(raw).__name__}")
    names = list(dict.fromkeys(g.name for g in cluster.groups))
    for key, v in raw.items():
        if key not in names:
            raise InputError(f"--efficiency {path}: {key!r} is not a node group of cluster {cluster.name} "
                             f"(its groups: {', '.join(names)})")
        if not _positive_number(v) or v > 1:
            raise InputError(f"--efficiency {path}: {key}={v!r}; a fraction of peak in (0, 1]")
    return {k: float(v) for k, v in raw.items()}


def group_as_cluster(g: NodeGroup, nodes: int, ranks_per_node: int) -> ClusterSpec:
    """The preset of a node group reshaped to a sub-cluster (a stage's data-parallel group)."""
    return dataclasses.replace(g.spec, nodes=max(1, nodes), ranks_per_node=ranks_per_node)
