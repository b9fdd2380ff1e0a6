"""The config check holds cluster.*, amsp.planner.* and the built-in tokenizer's size to what
the code they feed accepts: each value here got past it and failed later (a traceback from the planner, exit 1, or
a sentencepiece error minutes in), or was replaced silently."""
import logging
import os

import pytest
from omegaconf import OmegaConf

from configs.schema import ModelConfig, TrainConfig
from configs.validate import BUILTIN_MIN_VOCAB, ConfigError, validate_config


def cfg_with(**values):
    cfg = OmegaConf.structured(TrainConfig(model=ModelConfig()))
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=False)
    return cfg


def refused(cfg, what_if=False) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, what_if=what_if)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("key, value, allowed", [
    ("cluster.dtype", "fp8", "one of fp32|bf16"),  # a KeyError in from_config.resolve_measured_fields
    ("cluster.overlap_slowdown", 5.0, "in [0, 1]"),
    ("cluster.inter_bandwidth_gbs", -5.0, "> 0"),
    ("cluster.intra_bandwidth_gbs", 0.0, "> 0"),
    ("cluster.intra_latency_us", -1.0, ">= 0"),
    ("cluster.memory_bandwidth_gbs", 0.0, "> 0"),
    ("cluster.peak_tflops", 0.0, "> 0"),
    ("cluster.device_memory_gib", -1.0, "> 0"),
    ("cluster.nodes", 0, "an integer >= 1"),  # these three were replaced silently by the launch's shape
    ("cluster.nodes", -1, "an integer >= 1"),
    ("cluster.ranks_per_node", 0, "an integer >= 1"),
    ("amsp.planner.mfu", 1.5, "in (0, 1]"),
    ("amsp.planner.overlap_slowdown", 2.0, "in [0, 1]"),
    ("amsp.planner.state_budget_gib", 0.0, "> 0"),
    ("data.builtin.vocab_size", 5, f">= {BUILTIN_MIN_VOCAB}"),  # a sentencepiece INTERNAL error
])
def test_value_the_planner_or_tokenizer_refuses_is_one_config_line(key, value, allowed):
    msg = refused(cfg_with(**{key: value}))
    assert msg.startswith(f"{key}=") and allowed in msg, msg


def test_config_ranges_agree_with_the_code_that_reads_them():
    """At each boundary the config check accepts exactly what cost_model.Options / cluster.ClusterSpec accept."""
    from amsp.planner.cluster import cluster_from_config
    from amsp.planner.cost_model import Options

    def code_ok(make) -> bool:
        try:
            make()
        except ValueError:
            return False
        return True

    def check_ok(**values) -> bool:
        try:
            validate_config(cfg_with(**values))
        except ConfigError:
            return False
        return True

    for mfu in (0.0, 1e-3, 1.0, 1.01):
        assert check_ok(amsp__planner__mfu=mfu) == code_ok(lambda: Options(mfu=mfu)), mfu
    for s in (-0.1, 0.0, 1.0, 1.1):
        assert check_ok(amsp__planner__overlap_slowdown=s) == code_ok(lambda: Options(overlap_slowdown=s)), s
    for gib in (-1.0, 0.0, 0.5):
        assert check_ok(amsp__planner__state_budget_gib=gib) == \
            code_ok(lambda: Options(state_budget_bytes=gib * 2**30)), gib
    base = {"cluster.peak_tflops": 1.0, "cluster.device_memory_gib": 1.0}
    for key, values in {"overlap_slowdown": (-0.1, 0.0, 1.0, 1.1), "inter_bandwidth_gbs": (-5.0, 0.0, 0.5),
                        "intra_latency_us": (-1.0, 0.0, 3.0), "memory_bandwidth_gbs": (0.0, 1.0),
                        "nodes": (-1, 0, 1), "ranks_per_node": (0, 2), "peak_tflops": (0.0, 2.0),
                        "device_memory_gib": (-1.0, 4.0)}.items():
        for v in values:
            given = {**base, f"cluster.{key}": v}
            cfg = cfg_with(**given)
            assert check_ok(**given) == code_ok(lambda: cluster_from_config(cfg.cluster)), (key, v)


def test_planner_degrees_contradicting_parallel_are_refused_in_a_training_run_only():
    """with_model_parallel raised a ValueError traceback at startup; the planner CLI's what-ifs stay allowed."""
    msg = refused(cfg_with(amsp__planner__tp=2), what_if=False)
    assert msg.startswith("amsp.planner.tp=2, amsp.planner.pp=1 contradict parallel.tp=1, parallel.pp=1"), msg
    validate_config(cfg_with(amsp__planner__tp=2), what_if=True)  # python -m amsp.planner's what-if
    validate_config(cfg_with(amsp__planner__tp=2, parallel__tp=2), what_if=False)  # the same degrees
    # parallel.auto=true: they fix the joint planner's tp x pp
    validate_config(cfg_with(amsp__planner__pp=2, parallel__auto=True), what_if=False)
    # a what-if cannot contradict parallel.* named beside it either (with_model_parallel refuses it)
    assert "contradict parallel.tp=2" in refused(cfg_with(amsp__planner__tp=4, parallel__tp=2), what_if=True)


def test_planner_cli_keeps_its_what_ifs_and_refuses_bad_ranges():
    from amsp.planner.__main__ import checked_config

    assert checked_config(["model=debug", "amsp.planner.tp=2"]).amsp.planner.tp == 2
    with pytest.raises(ConfigError, match=r"^cluster.dtype='fp8' is not allowed"):
        checked_config(["model=debug", "cluster.dtype=fp8"])


def test_builtin_tokenizer_larger_than_the_model_is_refused_before_it_is_trained():
    # data/tokenizer.py check_fits_model's rule: the vocabulary padded to data.pad_vocab_multiple fits
    msg = refused(cfg_with(model__vocab_size=512, data__builtin__vocab_size=513))
    assert msg.startswith("data.builtin.vocab_size=513 is not allowed: expected at most model.vocab_size=512 once "
                          "padded to a multiple of data.pad_vocab_multiple=128 (it pads to 640)"), msg
    validate_config(cfg_with(model__vocab_size=512, data__builtin__vocab_size=500))  # pads to 512
    validate_config(cfg_with(model__vocab_size=512, data__builtin__vocab_size=513, data__pad_vocab_multiple=1,
                             data__prefix="x", data__tokenizer="t.model"))  # not the built-in corpus


def test_builtin_floor_is_the_pipelines():
    from data.pipeline import _BUILTIN_MIN_VOCAB

    assert BUILTIN_MIN_VOCAB == _BUILTIN_MIN_VOCAB
    validate_config(cfg_with(data__builtin__vocab_size=BUILTIN_MIN_VOCAB))


def test_bad_bandwidth_table_is_one_config_line():
    msg = refused(cfg_with(cluster__intra_node={"all_gatherr": {"1MiB": 3.0}}))
    assert msg.startswith("cluster.intra_node names unknown collective 'all_gatherr'"), msg
    validate_config(cfg_with(cluster__intra_node={"all_gather": {"1MiB": 3.0}}))


def test_schemas_are_not_group_options_and_help_names_the_command():
    """Each group's schema used to sit in its group, so `cluster=cluster_schema` composed the bare schema and
    train.py --help listed every schema as a preset; the groups' files still extend them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType
    from hydra.errors import MissingConfigException

    from configs.schema import ClusterConfig, register_configs
    from tests.conftest import ROOT

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base=None):
        loader = GlobalHydra.instance().config_loader()
        for group in ("amsp", "cluster", "data", "logging", "optim", "trainer"):
            options = loader.get_group_options(group, ObjectType.CONFIG)
            assert options and not [o for o in options if o.endswith("_schema")], (group, options)
        with pytest.raises(MissingConfigException, match="cluster/cluster_schema"):
            compose("train", overrides=["cluster=cluster_schema"])
        cfg = compose("train", overrides=["cluster=h100x8"], return_hydra_config=True)
        assert OmegaConf.get_type(cfg.cluster) is ClusterConfig and cfg.cluster.name == "h100x8"
        with pytest.raises(Exception, match="nodez"):  # typed by the schema the preset extends
            compose("train", overrides=["cluster=h100x8", "cluster.nodez=2"])
        help_text = cfg.hydra.help.template
    assert help_text.startswith("python train.py [group=option ...]") and "$APP_CONFIG_GROUPS" in help_text
    assert "parallel.cluster_file=configs/clusters_mixed/<name>.yaml" in help_text, help_text


def test_global_batch_tokens_not_a_multiple_of_seq_len_is_a_config_error():
    """batch_geometry's rule, in the config check: train.py refused it only after the process group had started
    and the run directory had been made."""
    said = refused(cfg_with(trainer__global_batch_tokens=1000, data__seq_len=256))
    assert "trainer.global_batch_tokens=1000 is not a multiple of data.seq_len=256" in said
    validate_config(cfg_with(trainer__global_batch_tokens=1024, data__seq_len=256))


def test_global_batch_tokens_says_which_batch_it_replaces(caplog):
    from amsp.batch_geometry import batch_geometry

    cfg = cfg_with(trainer__global_batch_tokens=8 * 256, data__seq_len=256, trainer__micro_batch_size=8)
    with caplog.at_level(logging.INFO, logger="amsp.batch_geometry"):
        assert batch_geometry(cfg, 1).global_batch == 8
    assert "trainer.global_batch_tokens=2048 (8 samples of data.seq_len=256) replaces trainer.global_batch_size=16" \
        in caplog.text
    caplog.clear()
    cfg.trainer.global_batch_tokens = 16 * 256  # they agree: nothing to say
    with caplog.at_level(logging.INFO, logger="amsp.batch_geometry"):
        batch_geometry(cfg, 1)
    assert "replaces" not in caplog.text


def test_launch_shape_replacing_the_clusters_is_said(caplog):
    from amsp.planner.from_config import say_launch_shape

    c = OmegaConf.create({"name": "h100x8", "nodes": 4, "ranks_per_node": 8})
    with caplog.at_level(logging.INFO, logger="amsp.planner.from_config"):
        say_launch_shape(c, 1, 2)
        say_launch_shape(c, 1, 2)  # startup prices the cluster more than once: said once
        say_launch_shape(c, 4, 8)  # the same shape: nothing replaced
    assert caplog.text.count("replace") == 1, caplog.text
    assert "the launch's 1 node(s) x 2 ranks replace cluster.nodes=4, cluster.ranks_per_node=8" in caplog.text


def test_train_py_refuses_them_in_one_line_before_anything_is_built(tmp_path):
    """The one end-to-end check: under train.py's @hydra.main the check sees a training run (planner what-ifs
    refused)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "train.py", "model=debug", "amsp.planner.tp=2",
                           "cluster.dtype=fp8", f"trainer.output_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: cluster.dtype='fp8' is not allowed"), lines[0]
    assert "amsp.planner.tp=2" in lines[0], lines[0]
    assert not any(tmp_path.iterdir())
