"""Which cluster preset describes the GPU a run is on, when no cluster was named.

train.py's default cluster is `cpu` (gloo ranks, figures measured at startup). On a CUDA device that
preset's 2 GB/s alpha-beta figures would price a single H100 as communication-bound, so a run on a
GPU with cluster=cpu plans with the preset of its device instead (configs/cluster/*.yaml), the
startup probe then replacing what it measures. Recognition is by substring of
torch.cuda.get_device_name(), most specific first. A part that shares a preset's interconnect but
not its chip figures (H100 PCIe / NVL, H800 PCIe) keeps the preset's links with its own datasheet
peak and memory bandwidth (DEVICE_VARIANTS).
"""
from __future__ import annotations

import logging
import pathlib

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

CLUSTER_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs" / "cluster"

# (substring of the CUDA device name, preset file) — longest names first when they overlap
DEVICE_PRESETS = (
    ("H200", "h200x8"),
    ("H800", "h100x8"),  # the H100's SMs and NVLink 4 (export variant with fewer NVLink lanes)
    ("H100", "h100x8"),
    ("A800", "a800x8"),
    ("A100", "a100x8"),
    ("V100", "v100x8"),
)
# Datasheet figures of parts whose preset describes another form factor: dense bf16 TFLOP/s (as
# amsp.metrics.peak's table) and HBM GB/s. Longest names first when they overlap.
DEVICE_VARIANTS = (
    ("H800 PCIe", {"peak_tflops": 756.0, "memory_bandwidth_gbs": 2000.0}),
    ("H100 PCIe", {"peak_tflops": 756.0, "memory_bandwidth_gbs": 2000.0}),
    ("H100 NVL", {"peak_tflops": 835.0, "memory_bandwidth_gbs": 3900.0}),
    ("A100-PCIE-40GB", {"memory_bandwidth_gbs": 1555.0}),
    ("A100 PCIe", {"memory_bandwidth_gbs": 1935.0}),
)


def preset_for_device(device_name: str) -> str | None:
    """The preset name for a CUDA device name, or None when no preset describes it."""
    for key, preset in DEVICE_PRESETS:
        if key.lower() in device_name.lower():
            return preset
    return None


def preset_path(preset: str) -> pathlib.Path:
    """The YAML of a node group's preset: a configs/cluster/ name, or the absolute path of a single node
    type's cluster file that read_cluster_file names as its own preset (its figures are that file's)."""
    p = pathlib.Path(preset)
    return p if p.is_absolute() and p.suffix in (".yaml", ".yml") else CLUSTER_DIR / f"{preset}.yaml"


def load_preset(name: str) -> DictConfig:
    """configs/cluster/NAME.yaml (or a single node type's file, preset_path) over the ClusterConfig schema
    (what `cluster=NAME` composes)."""
    from configs.schema import ClusterConfig

    path = preset_path(name)
    if not path.exists():
        raise ValueError(f"cluster preset {name!r} not found in {CLUSTER_DIR}")
    data = OmegaConf.to_container(OmegaConf.load(path))
    data.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(ClusterConfig), data)


def recognise(cluster_cfg: DictConfig, device_name: str | None, device_memory_gib: float | None = None) -> DictConfig:
    """The cluster node to plan with: `cluster_cfg` unless it is the cpu preset on a recognised GPU,
    then that GPU's preset with the real device memory (an A100 may be the 40 GB one). Logged."""
    if device_name is None or cluster_cfg.name != "cpu":
        return cluster_cfg
    preset = preset_for_device(device_name)
    if preset is None:
        log.warning("planner: no cluster preset for %s and none named; planning with the cpu preset's figures "
                    "(name one: cluster=%s, or give its figures)", device_name,
                    "|".join(sorted({p for _, p in DEVICE_PRESETS})))
        return cluster_cfg
    c = load_preset(preset)
    if device_memory_gib:
        c.device_memory_gib = float(device_memory_gib)
    variant = variant_of(device_name)
    for key, value in variant.items():
        setattr(c, key, value)
    log.info("planner: no cluster named on %s; using the %s preset (%.0f GiB/device%s)%s", device_name, preset,
             c.device_memory_gib, "".join(f", {k} {v:g}" for k, v in variant.items()),
             ", bandwidths replaced where the startup probe measures them")
    return c


def variant_of(device_name: str) -> dict:
    """The datasheet figures (DEVICE_VARIANTS) that differ from the recognised preset's, or {}."""
    for key, figures in DEVICE_VARIANTS:
        if key.lower() in device_name.lower():
            return dict(figures)
    return {}
