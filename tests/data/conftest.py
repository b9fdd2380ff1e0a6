"""Shared small fixtures: a few hundred KB of real text, a tokenizer trained on it, a preprocessed dataset."""
import json
import pathlib
import sysconfig

import pytest

from data.errors import DataError
from data.preprocess import preprocess
from data.tokenizer import train_bpe

UNICODE_DOC = "naïve café — 日本語のテキスト ✓ 🚀 Ωμέγα\n\ttabs and  double  spaces\n"


def stdlib_texts(n: int = 60, max_chars: int = 4000) -> list[str]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:n]
    return [f.read_text(encoding="utf-8")[:max_chars] for f in files]


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return stdlib_texts() + [UNICODE_DOC, "x", "short doc\n"]


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory, texts) -> str:
    d = tmp_path_factory.mktemp("tok")
    (d / "train.txt").write_text("\n".join(texts[:-3]), encoding="utf-8")
    return train_bpe([str(d / "train.txt")], str(d / "tok"), vocab_size=400, threads=1)


def raises_one_line(fn, *names):
    """fn() raises a one-line DataError naming each of `names`; returns its message."""
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert n in msg, msg
    return msg


def write_jsonl(path: pathlib.Path, texts, field: str = "text") -> pathlib.Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t, "other": 1}) + "\n")
    return path


@pytest.fixture(scope="session")
def dataset_prefix(tmp_path_factory, texts, tokenizer_model) -> str:
    d = tmp_path_factory.mktemp("ds")
    src = write_jsonl(d / "docs.jsonl", texts)
    prefix = str(d / "docs")
    preprocess([str(src)], prefix, tokenizer_model, workers=2, progress=False)
    return prefix
