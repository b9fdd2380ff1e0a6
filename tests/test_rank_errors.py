"""Startup checks that need no data come before the data build (train.run): an explicit plan's rules and the
node size were named only after the built-in corpus was extracted, a tokenizer trained and the text tokenized
(tens of seconds), and amsp.ranks_per_node that does not divide the world was first described ("(0 nodes)")."""
import pytest
from omegaconf import OmegaConf

from amsp.launch import DistEnv


def _run_until_the_data(monkeypatch, tmp_path, **values):
    """train.run on a debug config in this process, stopped where it would build the data."""
    import train
    from configs.schema import ModelConfig, TrainConfig

    cfg = OmegaConf.structured(TrainConfig(model=ModelConfig()))
    for key, value in {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 4,
                       "model.vocab_size": 512, "model.max_seq_len": 64, "data.seq_len": 32,
                       "trainer.device": "cpu", "trainer.output_dir": str(tmp_path), "logging.wandb.mode": "disabled",
                       "model.compile": "off", **values}.items():
        OmegaConf.update(cfg, key, value)

    def build_data(*args, **kwargs):
        raise AssertionError("the data was built before the check")

    monkeypatch.setattr(train, "build_data", build_data)
    monkeypatch.setattr(train, "setup_logging", lambda *a: None)  # it would replace pytest's log handlers
    monkeypatch.setattr(train, "set_threads", lambda *a: None)
    train.run(cfg)


@pytest.mark.parametrize("values, said", [
    ({"amsp.plan": "zero3", "amsp.p": 2}, "explicit degrees need p, g and os together"),
    ({"amsp.plan": "custom"}, "amsp.plan=custom needs explicit degrees"),
    ({"amsp.ranks_per_node": 2}, "amsp.ranks_per_node=2 does not divide the world size 1"),
    ({"amsp.plan": "zero3"}, None),  # a valid plan goes on to the data
])
def test_plan_and_node_size_are_refused_before_the_data_is_built(monkeypatch, tmp_path, values, said):
    from amsp.errors import classify

    with pytest.raises(Exception, match=said or "the data was built before the check") as e:
        _run_until_the_data(monkeypatch, tmp_path, **values)
    assert (classify(e.value) is not None) == (said is not None)  # a one-line input error, not a bug


def test_a_node_size_that_does_not_divide_the_world_is_refused_before_it_is_described():
    from amsp.build import describe_node_override

    one = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
    with pytest.raises(Exception, match="amsp.ranks_per_node=2 does not divide the world size 1"):
        describe_node_override(OmegaConf.create({"ranks_per_node": 2}), one)
    four = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, launcher="torchrun")
    assert "(2 nodes)" in describe_node_override(OmegaConf.create({"ranks_per_node": 2}), four)
