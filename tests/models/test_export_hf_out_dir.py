"""export_hf leaves OUT_DIR whole: it wrote model.safetensors before it looked at the tokenizer, so a
re-export with --dtype bfloat16 and a missing tokenizer failed (exit 2) with bf16 weights under the old
float32 config.json (from_pretrained loads that silently), and a new OUT_DIR was left holding only
model.safetensors. An OUT_DIR that is a file, or cannot be written, was a traceback (exit 1) after the
whole checkpoint had been read. Now every input is checked before the checkpoint is read, and the files
are written to a staging folder and moved into OUT_DIR only once all are written."""
from __future__ import annotations

import json
import os
import pathlib

import pytest
from safetensors import safe_open

from models.llama import export_hf
from models.llama.export_hf import export, main
from tests.models.test_hf import BASE, LlamaConfig, write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CFG = LlamaConfig(**{**BASE, "vocab_size": 64})


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> pathlib.Path:
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    (d / "c.txt").write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(d / "c.txt"), model_prefix=str(d / "sp"), vocab_size=64,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return d / "sp.model"


@pytest.fixture
def ckpt(tmp_path, sp_model) -> pathlib.Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    write_checkpoint(d, CFG, seed=0, tokenizer=sp_model)
    return d


def snapshot(d: pathlib.Path) -> dict[str, bytes]:
    """Every entry of d, hidden ones included (a staging folder left behind would show)."""
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in d.iterdir()}


def weights_dtype(d: pathlib.Path) -> str:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return str(f.get_tensor(next(iter(f.keys()))).dtype)


@pytest.fixture
def no_checkpoint_read(monkeypatch):
    """Fails the test if the export reaches the (slow) checkpoint read."""
    def read(*_):
        raise AssertionError("the checkpoint was read before the inputs were checked")
    monkeypatch.setattr(export_hf, "_load_model_state", read)


def test_a_failed_re_export_leaves_out_dir_as_it_was(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    export(ckpt, out)
    before = snapshot(out)
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.json"} <= set(before)
    assert weights_dtype(out) == "torch.float32"
    junk = tmp_path / "junk.model"
    junk.write_text("not a tokenizer\n")
    monkeypatch.setattr(export_hf, "_load_model_state", lambda *_: pytest.fail("checkpoint read"))
    for tok in (tmp_path / "missing.model", junk):  # absent; present but does not convert
        assert main([str(ckpt), str(out), "--dtype", "bfloat16", "--tokenizer", str(tok)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(tok) in err[0], err
        assert snapshot(out) == before  # was: bf16 model.safetensors under a float32 config.json
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf", "junk.model"]


def test_a_failed_export_to_a_new_out_dir_leaves_nothing(ckpt, tmp_path, capsys, no_checkpoint_read):
    out = tmp_path / "new" / "hf"
    assert main([str(ckpt), str(out), "--tokenizer", str(tmp_path / "missing.model")]) == 2
    assert capsys.readouterr().err.strip() == f"error: tokenizer {tmp_path / 'missing.model'} does not exist"
    assert not out.exists() and not out.parent.exists()  # was: OUT_DIR holding only model.safetensors


def test_a_failure_while_reading_the_checkpoint_leaves_no_staging_folder(ckpt, tmp_path, monkeypatch):
    def damaged(*_):
        raise ValueError("damaged")
    monkeypatch.setattr(export_hf, "_load_model_state", damaged)
    with pytest.raises(ValueError, match="damaged"):
        export(ckpt, tmp_path / "new")
    existing = tmp_path / "old"
    existing.mkdir()
    (existing / "README.md").write_text("mine")
    with pytest.raises(ValueError, match="damaged"):
        export(ckpt, existing)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "old"] and os.listdir(existing) == ["README.md"]


def test_a_re_export_replaces_every_file_of_the_previous_one(ckpt, tmp_path):
    out = tmp_path / "hf"
    export(ckpt, out)
    (out / "README.md").write_text("a user's file stays")
    bare = tmp_path / "bare"
    bare.mkdir()
    write_checkpoint(bare, CFG, seed=1)  # names no tokenizer: the old tokenizer files must not stay
    export(bare, out, dtype="bfloat16")
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert weights_dtype(out) == "torch.bfloat16"


def test_a_new_out_dir_gets_the_usual_mode(ckpt, tmp_path):
    umask = os.umask(0o022)
    try:
        export(ckpt, tmp_path / "hf")
    finally:
        os.umask(umask)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o755  # not the staging folder's 0700


def test_an_unusable_out_dir_is_one_line_before_the_checkpoint_is_read(ckpt, tmp_path, capsys, monkeypatch,
                                                                       no_checkpoint_read):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main([str(ckpt), str(a_file)]) == 2  # was FileExistsError, exit 1, after the checkpoint read
    assert capsys.readouterr().err.strip() == f"error: OUT_DIR {a_file} exists and is not a directory"
    assert main([str(ckpt), str(a_file / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write OUT_DIR {a_file / 'hf'}: making a folder in {a_file} failed"), err
    assert a_file.read_text() == "x"

    def denied(*_, **__):  # a parent the user cannot write (as root, chmod 555 would not stop the test)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(export_hf.tempfile, "mkdtemp", denied)
    assert main([str(ckpt), str(tmp_path / "hf")]) == 2  # was PermissionError, exit 1
    assert capsys.readouterr().err.strip() == (f"error: cannot write OUT_DIR {tmp_path / 'hf'}: making a folder in "
                                               f"{tmp_path} failed: Permission denied")
