"""The exported tokenizer (models/llama/hf.py write_tokenizer) encodes exactly as training did.

For every tokenizer kind, transformers' AutoTokenizer on the exported folder gives the ids of
data/tokenizer.py (what preprocessing wrote and training saw) on strings with leading, trailing and
repeated spaces, tabs, newlines, indented code, non-ASCII text and special-token spellings, with
add_special_tokens on and off (training adds no BOS; EOS only ends documents). The last test runs a
tiktoken file through preprocessing, a LLaMA-3-shaped train.py run and export, end to end.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from data.tokenizer import load_tokenizer, train_bpe
from models.llama.hf import write_tokenizer
from tests.tokenizer_files import TRICKY, make_tiktoken_file, make_tokenizer_json, training_texts

transformers = pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def strings() -> list[str]:
    code = "class A:\n    def f(self):\n        for i in range(3):\n\t\t  pass  \n"
    return TRICKY + [code, "  " + code, code + "   ", "\n\n" + code] + [
        t[i:i + 200] for t in training_texts(8) for i in range(0, 3000, 401)]


def sp_models(tmp_path: pathlib.Path) -> dict[str, str]:
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(training_texts()), encoding="utf-8")
    ours = train_bpe([str(corpus)], str(tmp_path / "ours"), 500, threads=1)  # identity, byte fallback
    # sentencepiece's defaults (nmt_nfkc normalisation, extra whitespace removed), as many models ship.
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "dflt"), vocab_size=500,
                                   model_type="bpe", byte_fallback=True, minloglevel=2, num_threads=1)
    return {"sentencepiece": ours, "sentencepiece-nmt_nfkc": str(tmp_path / "dflt.model")}


def exported(tok_file: str, out: pathlib.Path):
    out.mkdir(parents=True)
    special = write_tokenizer(tok_file, out, max_len=4096)
    return transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True), special


def assert_same_ids(auto, tok) -> None:
    for s in strings():
        want = tok.encode(s)
        assert auto(s)["input_ids"] == want, (tok.kind, s)
        assert auto(s, add_special_tokens=False)["input_ids"] == want, (tok.kind, s)
        assert auto.decode(want) == tok.decode(want), (tok.kind, s)
    batch = ["a", " b  ", "\tc\n"]
    assert auto(batch)["input_ids"] == [tok.encode(s) for s in batch]


def test_every_kind_exports_the_ids_training_saw(tmp_path):
    files = {**sp_models(tmp_path), "hf": str(make_tokenizer_json(tmp_path / "hf" / "tokenizer.json")),
             "tiktoken": str(make_tiktoken_file(tmp_path / "tt" / "tokenizer.model"))}
    for name, f in files.items():
        tok = load_tokenizer(f)
        auto, special = exported(f, tmp_path / "out" / name)
        assert_same_ids(auto, tok)
        assert (special["bos"], special["eos"]) == (tok.bos_id, tok.eos_id)
        assert (auto.eos_token_id, auto.bos_token_id) == (tok.eos_id, tok.bos_id)
        cfg = json.loads((tmp_path / "out" / name / "tokenizer_config.json").read_text())
        assert (cfg["add_bos_token"], cfg["add_eos_token"], cfg["split_special_tokens"]) == (False, False, True)
    # The sentencepiece case that used to differ: a leading space keeps its own "▁" as in training.
    sp = spm.SentencePieceProcessor(model_file=files["sentencepiece"])
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out" / "sentencepiece"))
    assert auto.convert_ids_to_tokens(auto(" x")["input_ids"]) == sp.encode(" x", out_type=str)
    assert (tmp_path / "out" / "tiktoken" / "tokenizer.tiktoken").read_bytes() == pathlib.Path(
        files["tiktoken"]).read_bytes()


def test_a_model_that_cannot_convert_exactly_is_refused(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(training_texts(10)), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "uni"), vocab_size=300,
                                   model_type="unigram", minloglevel=2, num_threads=1)
    assert load_tokenizer(str(tmp_path / "uni.model")).encode("x")  # trains and preprocesses fine
    with pytest.raises(ValueError, match="cannot export this sentencepiece model exactly.*model_type=UNIGRAM"):
        write_tokenizer(str(tmp_path / "uni.model"), tmp_path, max_len=16)


def test_a_bos_template_in_tokenizer_json_is_not_exported(tmp_path):
    """A LLaMA-3 tokenizer.json adds <|begin_of_text|> in its post-processor; training did not."""
    from tokenizers import Tokenizer, processors

    path = make_tokenizer_json(tmp_path / "src" / "tokenizer.json")
    t = Tokenizer.from_file(str(path))
    bos = t.token_to_id("<|begin_of_text|>")
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])])
    t.save(str(path))
    assert t.encode("x").ids[0] == bos  # the file itself would add BOS
    tok = load_tokenizer(str(path))
    assert tok.encode("x") == t.encode("x", add_special_tokens=False).ids
    auto, _ = exported(str(path), tmp_path / "out")
    assert_same_ids(auto, tok)
    kept = json.loads((tmp_path / "out" / "tokenizer.json").read_text())["post_processor"]
    assert kept["type"] == "Sequence" and [p["type"] for p in kept["processors"]] == ["ByteLevel"]


def test_tiktoken_file_drives_preprocessing_a_llama3_run_and_export(tmp_path):
    from data.indexed_dataset import IndexedDataset
    from data.preprocess import preprocess

    tok_file = make_tiktoken_file(tmp_path / "tok" / "tokenizer.model")  # LLaMA-3's name for its tiktoken file
    docs = [t for t in training_texts(30) if t]
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as f:
        for t in docs:
            f.write(json.dumps({"text": t}) + "\n")
    preprocess([str(tmp_path / "docs.jsonl")], str(tmp_path / "corpus"), str(tok_file), progress=False)
    tok = load_tokenizer(str(tok_file))
    ds = IndexedDataset(str(tmp_path / "corpus"))
    assert [ds.doc(i).tolist() for i in range(3)] == [tok.encode(d) + [tok.eos_id] for d in docs[:3]]
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert (meta["tokenizer_kind"], meta["bos_per_document"], meta["eos_per_document"]) == ("tiktoken", False, True)
    run = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"trainer.output_dir={run}", "model=llama3_8b", "model.dim=64",
           "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=32",
           "model.vocab_size=1024", "model.max_seq_len=128", f"data.prefix={tmp_path / 'corpus'}",
           f"data.tokenizer={tok_file}", "data.seq_len=32", "trainer.global_batch_size=4",
           "trainer.micro_batch_size=4", "trainer.max_steps=3", "trainer.log_interval=1", "data.valid_samples=8",
           "logging.wandb.mode=disabled"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len([ln for ln in r.stdout.splitlines() if "| loss " in ln]) == 3
    assert "(tiktoken): 854 pieces, padded to 896" in r.stdout and "validation loss" in r.stdout
    run_dirs = [p.parent for p in run.rglob("tokenizer.tiktoken")]
    assert len(run_dirs) == 1 and (run_dirs[0] / "tokenizer.tiktoken").read_bytes() == tok_file.read_bytes()
    from models.llama.export_hf import export

    export(run_dirs[0], tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert_same_ids(auto, tok)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["eos_token_id"], cfg["bos_token_id"]) == (1024, tok.eos_id, tok.bos_id)
    assert np.isfinite([float(x.split("| loss ")[1].split()[0]) for x in r.stdout.splitlines() if "| loss " in x]).all()
