"""What a checkpoint records about the data (data/resume_check.py): a changed validation split is a
data change, since the held-out documents decide the training stream too."""
from data.resume_check import changes

BASE = {"seq_len": 64, "tokenizer_sha256": "a" * 64, "tokenizer_file": "/t.model", "tokenizer_vocab_size": 512,
        "model_vocab_size": 512, "data_sources": [[1.0, "/d/x"]], "data_sizes": [[2000, 97601]],
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


def test_same_prefix_preprocessed_again_is_a_data_change():
    """The prefix alone let a resume continue at a sample count that now points into another shuffled
    stream after the dataset was preprocessed again with more documents."""
    old = dict(BASE)
    found = changes(old, {**BASE, "data_sizes": [[2001, 115991]]})
    assert found["data"] == ("data contents under the same prefix /d/x: 2000 documents, 97601 tokens -> "
                             "2001 documents, 115991 tokens"), found
    assert changes(old, {**BASE, "data_sizes": [[2000, 97601]]}) == {}
    # Both at once: one message for the data change, naming each.
    both = changes(old, {**BASE, "data_sizes": [[1, 2]], "data_split": {"split": [90.0, 10.0], "split_seed": 1234}})
    assert "data contents" in both["data"] and "validation split" in both["data"]
    # A checkpoint from before the sizes were recorded is compared on what it has.
    before = {k: v for k, v in BASE.items() if k != "data_sizes"}
    assert changes(before, {**BASE, "data_sizes": [[1, 2]]}) == {}
