"""What a checkpoint records about the data (data/resume_check.py): a changed validation split is a
data change, since the held-out documents decide the training stream too."""
from data.resume_check import changes

BASE = {"seq_len": 64, "tokenizer_sha256": "a" * 64, "tokenizer_file": "/t.model", "tokenizer_vocab_size": 512,
        "model_vocab_size": 512, "data_sources": [[1.0, "/d/x"]],
        "data_split": {"split": [98.0, 2.0], "split_seed": 1234}}


def test_same_identity_is_no_change():
    assert changes(dict(BASE), dict(BASE)) == {}


def test_changed_split_seed_or_share_is_a_data_change():
    for now_split in ({"split": [98.0, 2.0], "split_seed": 7}, {"split": [90.0, 10.0], "split_seed": 1234}):
        found = changes(dict(BASE), {**BASE, "data_split": now_split})
        assert set(found) == {"data"} and "validation split" in found["data"], found


def test_checkpoint_from_before_the_random_split_is_a_data_change():
    old = {k: v for k, v in BASE.items() if k != "data_split"}
    found = changes(old, dict(BASE))
    assert "before data.split_seed" in found["data"]


def test_changed_sources_are_reported_once_as_sources():
    found = changes(dict(BASE), {**BASE, "data_sources": [[1.0, "/d/y"]], "data_split": {"split": [1.0], "split_seed": 1}})
    assert found["data"].startswith("data sources")
