"""The outputs of data.preprocess and data.tokenizer: never an input, never half-written, and a stop by signal
or a failed write is one line with everything the run created removed."""
import errno
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import pytest

import data.indexed_dataset as indexed_dataset
import data.tokenizer as tokenizer_mod
from data.preprocess import _init_worker, _pool_with_default_sigterm, main as preprocess_main, preprocess
from data.tok_sentencepiece import spm
from tests.data.conftest import raises_one_line, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(capsys, fn, argv):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    return e.value.code, capsys.readouterr().err.strip()


def _files(d):
    return sorted(os.listdir(d))


# 1. PREFIX.json named as an input was replaced by the metadata: the corpus was lost.
def test_output_that_is_an_input_is_refused(tmp_path, texts, tokenizer_model):
    src = write_jsonl(tmp_path / "web.json", texts[:3])
    before = src.read_bytes()
    raises_one_line(lambda: preprocess([str(src)], str(tmp_path / "web"), tokenizer_model, workers=1,
                                       progress=False), "--output-prefix", "overwrite", str(src))
    assert src.read_bytes() == before and _files(tmp_path) == ["web.json"]


# 1b. Outputs in an input folder were read back as input by the next run (its PREFIX.json is no document).
def test_output_inside_an_input_folder_is_refused(tmp_path, texts, tokenizer_model):
    write_jsonl(tmp_path / "a.jsonl", texts[:3])
    for prefix in (tmp_path / "out", tmp_path / "sub" / "out"):
        raises_one_line(lambda: preprocess([str(tmp_path)], str(prefix), tokenizer_model, workers=1,
                                           progress=False), "--output-prefix", "inside the input folder")
    assert _files(tmp_path) == ["a.jsonl"]


# 2. A worker that took Ctrl-C's SIGINT inside the result queue's put() left its lock held: terminate() hung.
def _worker_signal_state():
    return int(signal.getsignal(signal.SIGINT)), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_workers_ignore_sigint(tokenizer_model):
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        _init_worker(tokenizer_model)  # in this process: the disposition it sets
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    if "fork" in mp.get_all_start_methods():  # and in a real worker, not blocked either
        # the parent's own disposition: Python's handler from a terminal, SIG_IGN when pytest runs in the
        # background of a non-interactive shell (which starts it with SIGINT ignored)
        parent = signal.getsignal(signal.SIGINT)
        pool = _pool_with_default_sigterm(mp.get_context("fork"), 1, tokenizer_model)
        try:
            assert pool.apply(_worker_signal_state) == (int(signal.SIG_IGN), False)
        finally:
            pool.close()
            pool.join()
        assert signal.getsignal(signal.SIGINT) is parent  # the parent's is unchanged


# 3. A full disk removed the earlier PREFIX.json before the new files were complete, with a traceback.
@pytest.mark.parametrize("stage", ["bin", "idx"])
def test_full_disk_leaves_the_earlier_dataset_whole(tmp_path, texts, tokenizer_model, monkeypatch, stage):
    src = write_jsonl(tmp_path / "a.jsonl", texts[:5])
    prefix = str(tmp_path / "out" / "x")
    preprocess([str(src)], prefix, tokenizer_model, workers=1, progress=False)
    before = {n: (tmp_path / "out" / n).read_bytes() for n in _files(tmp_path / "out")}

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if stage == "bin":
        monkeypatch.setattr(indexed_dataset.IndexedDatasetWriter, "add_documents", full)
    else:
        monkeypatch.setattr(indexed_dataset, "write_index", full)
    raises_one_line(lambda: preprocess([str(src)], prefix, tokenizer_model, workers=1, progress=False),
                    "--output-prefix", prefix, "No space left")
    assert {n: (tmp_path / "out" / n).read_bytes() for n in _files(tmp_path / "out")} == before
    assert sorted(before) == ["x.bin", "x.idx", "x.json"]


# 4. An output directory that cannot be written was a traceback (PermissionError, FileNotFoundError).
def test_unwritable_output_directory_is_one_line(tmp_path, texts, tokenizer_model, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", texts[:3])
    # /proc/self is a directory no one can create files in, root included (chmod 555 does not stop root)
    code, err = _cli(capsys, preprocess_main, ["--input", str(src), "--output-prefix", "/proc/self/x",
                                               "--tokenizer", tokenizer_model, "--workers", "1", "--no-progress"])
    assert code == 2 and len(err.splitlines()) == 1 and "--output-prefix" in err and "/proc/self/x" in err, err
    code, err = _cli(capsys, tokenizer_mod.main, ["--input", str(src), "--prefix", "/proc/self/t",
                                                  "--vocab-size", "400"])
    assert code == 2 and len(err.splitlines()) == 1 and "--prefix" in err and "/proc/self/t" in err, err


# 5. Ctrl-C right after sentencepiece's C++ training left PREFIX.tmp-PID.model/.vocab and a traceback.
def test_tokenizer_interrupt_after_training_cleans_up(tmp_path, texts, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", texts[:20])
    real_train = spm.SentencePieceTrainer.train

    def train_then_interrupt(**kw):
        real_train(**kw)
        raise KeyboardInterrupt
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", train_then_interrupt)
    code, err = _cli(capsys, tokenizer_mod.main, ["--input", str(src), "--prefix", str(tmp_path / "tok" / "t"),
                                                  "--vocab-size", "400"])
    assert code == 130 and len(err.splitlines()) == 1 and "Ctrl-C" in err, err
    assert _files(tmp_path) == ["a.jsonl"]  # nor the tok/ folder it created


# 5b. SIGTERM while the corpus is copied for sentencepiece left that copy behind, and no message. A real
# signal: in a subprocess, so that the old behaviour (death by SIGTERM) cannot take the test runner along.
def test_tokenizer_sigterm_removes_its_copy_of_the_corpus(tmp_path, texts):
    src = write_jsonl(tmp_path / "a.jsonl", texts[:20])
    code = ("import os, signal, time, data.tokenizer as t\n"
            "t.count_sentences = lambda f: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))\n"
            f"t.main(['--input', {str(src)!r}, '--prefix', {str(tmp_path / 'tok' / 't')!r}, '--vocab-size', '400'])\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    err = p.stderr.strip()
    assert p.returncode == 143 and len(err.splitlines()) == 1 and "SIGTERM" in err, (p.returncode, err)
    assert _files(tmp_path) == ["a.jsonl"]


# 6. Ctrl-C in data.preprocess cleaned up but printed a 20-line KeyboardInterrupt traceback.
def test_preprocess_interrupt_is_one_line(tmp_path, texts, tokenizer_model, monkeypatch, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", texts[:5])

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(indexed_dataset.IndexedDatasetWriter, "add_documents", interrupted)
    parent = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs in a non-interactive shell's background
    code, err = _cli(capsys, preprocess_main, ["--input", str(src), "--output-prefix", str(tmp_path / "o" / "x"),
                                               "--tokenizer", tokenizer_model, "--workers", "2", "--no-progress"])
    assert code == 130 and len(err.splitlines()) == 1 and "Ctrl-C" in err and "x not written" in err, err
    assert _files(tmp_path) == ["a.jsonl"]
    assert signal.getsignal(signal.SIGINT) is parent  # main() put the handler back


# data.tokenizer with --prefix inside its --input folder trained on its own copy of the text as well.
def test_tokenizer_prefix_in_the_input_folder_reads_the_inputs_only(tmp_path, texts, capsys):
    write_jsonl(tmp_path / "a.jsonl", texts[:20])
    tokenizer_mod.main(["--input", str(tmp_path), "--prefix", str(tmp_path / "tok"), "--vocab-size", "400"])
    assert "from 20 documents" in capsys.readouterr().out
    assert _files(tmp_path) == ["a.jsonl", "tok.model", "tok.vocab"]
