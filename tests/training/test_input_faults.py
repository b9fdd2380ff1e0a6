"""Bad inputs at startup and on resume: each ends as one line and exit 2, or runs on with a warning
that names the change; no checkpoint or metrics row is lost or duplicated (issue 17, items 3-4)."""
import json
import shutil

import pytest

from data.indexed_dataset import IndexedDataset
from data.preprocess import preprocess
from data.tokenizer import train_bpe
from tests.data.conftest import stdlib_texts, write_jsonl
from tests.training.runs import records, train

pytestmark = pytest.mark.distributed  # train.py subprocesses


def one_line_error(proc, kind: str = "input error") -> str:
    """The run failed with exit 2 and exactly one line on stderr, no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "HYDRA_FULL_ERROR" not in out, out[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "UserWarning" not in ln
             and "return func(" not in ln]
    assert len(lines) == 1 and lines[0].startswith(f"{kind}: "), proc.stderr[-3000:]
    return lines[0]


def snapshot(run_dir):
    """Every file under the run's checkpoints, with its bytes: a refused resume must leave them alone."""
    root = run_dir / "checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def latest_meta(run_dir) -> dict:
    name = (run_dir / "checkpoints" / "latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())


def rows(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two small tokenizers (400 and 450 pieces) and datasets made with each; a copy of the first
    dataset under another prefix (same tokens, other source)."""
    d = tmp_path_factory.mktemp("corpus")
    texts = stdlib_texts(40)
    (d / "t.txt").write_text("\n".join(texts), encoding="utf-8")
    tok_a = train_bpe([str(d / "t.txt")], str(d / "tok_a"), vocab_size=400, threads=1)
    tok_b = train_bpe([str(d / "t.txt")], str(d / "tok_b"), vocab_size=450, threads=1)
    src = write_jsonl(d / "docs.jsonl", texts)
    preprocess([str(src)], str(d / "ds_a"), tok_a, progress=False)
    preprocess([str(src)], str(d / "ds_b"), tok_b, progress=False)
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(str(d / "ds_a") + ext, str(d / "ds_a2") + ext)
    return {"tok_a": tok_a, "tok_b": tok_b, "ds_a": str(d / "ds_a"), "ds_b": str(d / "ds_b"),
            "ds_a2": str(d / "ds_a2"), "dir": d}


def test_resume_refuses_a_changed_seq_len_or_vocab_and_allows_it_when_told(tmp_path):
    run = tmp_path / "seq"
    common = ["trainer.checkpoint_interval=2", "trainer.val_interval=2", "trainer.val_samples=8"]
    # max_steps a multiple of val_interval: the final validation runs once, not twice
    train(run, "trainer.max_steps=4", *common)
    assert rows(run / "validation.jsonl") == [2, 4]
    assert latest_meta(run)["consumed_samples"] == 32 and latest_meta(run)["seq_len"] == 32

    # A run that went past its last checkpoint and was killed: rows for steps 5, 6 and a torn line.
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + json.dumps({"step": 6, "loss": 1.0}) + "\n"
                + '{"step": 7, "lo')
    with open(run / "validation.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "val_loss": 1.0}) + "\n")
    before, metrics_before = snapshot(run), (run / "metrics.jsonl").read_bytes()

    proc = train(run, "trainer.max_steps=6", "data.seq_len=16", *common, check=False)
    line = one_line_error(proc)
    assert line == (f"input error: cannot resume from {run}/checkpoints/step_00000004: data.seq_len 32 -> 16 since "
                    "it was written (its data position of 32 samples means other data now). Restore the old "
                    "value(s), or allow it with trainer.allow_resume_changes=[seq_len]"), line
    proc = train(run, "trainer.max_steps=6", "model.vocab_size=4096", *common, check=False)
    line = one_line_error(proc)
    assert line == (f"input error: cannot resume from {run}/checkpoints/step_00000004: model.vocab_size 8192 -> "
                    "4096; the embedding and output layers were trained at 8192 rows and cannot load at another "
                    "size. Set model.vocab_size=8192, or start a new run (another trainer.run_name)"), line
    assert snapshot(run) == before and (run / "metrics.jsonl").read_bytes() == metrics_before  # nothing touched

    proc = train(run, "trainer.max_steps=6", "data.seq_len=16", "trainer.allow_resume_changes=[seq_len]", *common)
    warnings = [ln for ln in proc.stdout.splitlines() if "allowed by trainer.allow_resume_changes" in ln]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"resuming from {run}/checkpoints/step_00000004 with a change allowed by trainer.allow_resume_changes: "
        "data.seq_len 32 -> 16 (data position converted by tokens: 32 samples of 32 tokens -> 64 samples of 16)"), \
        proc.stdout[-3000:]
    # 32 samples x 32 tokens = 64 x 16 consumed before; then 2 steps of 8 samples
    assert latest_meta(run)["consumed_samples"] == 80 and latest_meta(run)["seq_len"] == 16
    # the killed run's rows after step 4 (and the torn line) are gone; every step appears once
    assert "metrics.jsonl: dropped 3 row(s) after step 4" in proc.stdout
    assert "validation.jsonl: dropped 1 row(s) after step 4" in proc.stdout
    assert rows(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert rows(run / "validation.jsonl") == [2, 4, 6]


# Slow (the suite's time budget): the default run keeps the seq_len/vocab refusal, which goes through the same
# identity check.
@pytest.mark.slow
def test_resume_refuses_another_tokenizer_or_data_and_allows_data_when_told(tmp_path, corpus):
    run = tmp_path / "tok"
    data_a = [f"data.prefix={corpus['ds_a']}", f"data.tokenizer={corpus['tok_a']}"]
    train(run, "trainer.max_steps=2", *data_a)
    before = snapshot(run)
    meta = latest_meta(run)
    assert meta["tokenizer_vocab_size"] == 400 and meta["data_sources"] == [[1.0, corpus["ds_a"]]]
    ds_a = IndexedDataset(corpus["ds_a"])  # its contents too: the same prefix preprocessed again is other data
    assert meta["data_sizes"] == [[ds_a.num_docs, ds_a.num_tokens]]

    proc = train(run, "trainer.max_steps=4", f"data.prefix={corpus['ds_b']}", f"data.tokenizer={corpus['tok_b']}",
                 check=False)
    line = one_line_error(proc)
    sha_a = meta["tokenizer_sha256"][:12]
    assert line.startswith(f"input error: cannot resume from {run}/checkpoints/step_00000002: tokenizer "
                           f"{corpus['tok_a']} (sha256 {sha_a}) -> {corpus['tok_b']} (sha256 "), line
    assert ", 400 -> 450 pieces; data sources [[1, " + corpus["ds_a"] + "]] -> [[1, " + corpus["ds_b"] + "]]" in line
    assert line.endswith("allow it with trainer.allow_resume_changes=[tokenizer,data]"), line
    assert snapshot(run) == before

    data_a2 = [f"data.prefix={corpus['ds_a2']}", f"data.tokenizer={corpus['tok_a']}"]
    line = one_line_error(train(run, "trainer.max_steps=4", *data_a2, check=False))
    assert "data sources [[1, " + corpus["ds_a"] + "]] -> [[1, " + corpus["ds_a2"] + "]]" in line
    assert line.endswith("trainer.allow_resume_changes=[data]") and "tokenizer" not in line.split(":")[2], line
    assert snapshot(run) == before

    proc = train(run, "trainer.max_steps=4", *data_a2, "trainer.allow_resume_changes=[data]")
    assert (f"with a change allowed by trainer.allow_resume_changes: data sources [[1, {corpus['ds_a']}]] -> "
            f"[[1, {corpus['ds_a2']}]] (data position kept at 16 samples of the new stream)") in proc.stdout
    assert latest_meta(run)["consumed_samples"] == 32 and [r["step"] for r in records(run)] == [1, 2, 3, 4]


def test_allow_resume_changes_entries_are_validated(tmp_path):
    line = one_line_error(train(tmp_path / "v", "trainer.allow_resume_changes=[seqlen]", check=False),
                          kind="config error")
    assert line == ("config error: trainer.allow_resume_changes=['seqlen'] is not allowed: expected a list of "
                    "seq_len|tokenizer|data|model|schedule"), line
    assert not (tmp_path / "v").exists()


def nothing_published(run) -> bool:
    """No checkpoint and no lock left: the run directory's lock is taken first (checkpoints/ exists from
    the start) and released on the way out."""
    ck = run / "checkpoints"
    return not (ck / "latest").exists() and not list(ck.glob("step_*")) and not (ck / ".lock").exists()


@pytest.mark.parametrize("case", ["missing_prefix", "garbage_tokenizer", "vocab_mismatch", "val_below_a_round"])
def test_startup_data_errors_are_one_line(tmp_path, corpus, case):
    run = tmp_path / case
    if case == "missing_prefix":
        missing = str(tmp_path / "nowhere" / "corpus")
        proc = train(run, f"data.prefix={missing}", f"data.tokenizer={corpus['tok_a']}", check=False)
        line = one_line_error(proc)
        assert line == (f"input error: {missing}.idx: file not found (expected PREFIX.idx and PREFIX.bin from "
                        "python -m data.preprocess)"), line
        # before the partitioner's probes and compute timing (tens of seconds on a cluster), not after them
        assert "amsp.planner" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    elif case == "garbage_tokenizer":
        bad = tmp_path / "garbage.model"
        bad.write_bytes(b"\x00\xffnot a sentencepiece model\n" * 10)
        line = one_line_error(train(run, f"data.prefix={corpus['ds_a']}", f"data.tokenizer={bad}", check=False))
        assert line.startswith(f"input error: {bad}: not a sentencepiece model ("), line
    elif case == "val_below_a_round":  # it would evaluate no sample and log NaN as the validation loss
        line = one_line_error(train(run, "trainer.val_samples=1", check=False))
        assert line == ("input error: validation runs whole rounds of trainer.micro_batch_size x data-parallel "
                        "ranks = 2 x 1 = 2 samples and trainer.val_samples=1 is less: set trainer.val_samples >= 2 "
                        "or set trainer.val_samples=0 to skip it"), line
    else:
        line = one_line_error(train(run, f"data.prefix={corpus['ds_a']}", f"data.tokenizer={corpus['tok_a']}",
                                    "model.vocab_size=256", check=False))
        assert line == (f"input error: {corpus['tok_a']}: tokenizer vocabulary 400 (padded to 512, a multiple of "
                        "data.pad_vocab_multiple=128) exceeds model.vocab_size=256; use a larger model vocabulary "
                        "or a smaller tokenizer"), line
    assert nothing_published(run)


_MEMORY_CAP_MIB = 3000  # address space: enough for torch and a debug run, not for this model's ~6 GiB of state


@pytest.mark.parametrize("plan", [pytest.param("auto", marks=pytest.mark.slow), "zero3"])
def test_out_of_memory_at_startup_is_one_line_with_the_planners_numbers(tmp_path, plan):
    import os
    import re
    import resource
    import subprocess
    import sys

    from tests.training.runs import ROOT

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_CAP_MIB << 20, _MEMORY_CAP_MIB << 20))

    run = tmp_path / "oom"
    args = [f"trainer.output_dir={tmp_path}", "trainer.run_name=oom", "model=tiny", "model.dim=1536",
            "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=4", "data.seq_len=32",
            "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.max_steps=1",
            "logging.wandb.mode=disabled", "logging.plot=false", "trainer.val_samples=0", f"amsp.plan={plan}"]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=cap, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "Traceback" not in out and "HYDRA_FULL_ERROR" not in out, out[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("fault: rank 0 ran out of memory building the model on cpu (DefaultCPUAllocator could "
                           "not allocate "), line
    # the state parts are the model's; the total and the memory assumed depend on this host's RAM
    assert re.search(rf"; the planner predicted \d+\.\d\d GiB per rank for plan {plan} \(p/g/os = 1/1/1\) "
                     r"\(params 1\.22, grads 1\.22, optim 2\.44, .* GiB\) against \d+\.\d\d GiB of device memory "
                     r"assumed\. ", line), line
    assert " GiB of device memory assumed. " in line and line.endswith("shard more (amsp.plan=zero3) or use more "
                                                                        "ranks"), line
    assert nothing_published(run)


def test_drop_rows_after_rewrites_only_when_needed(tmp_path, caplog):
    import logging
    import os

    from amsp.metrics.logger import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    assert drop_rows_after(path, 3) == 0 and not path.exists()  # no file: nothing to do
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    mtime = os.stat(path).st_mtime_ns
    assert drop_rows_after(path, 3) == 0 and os.stat(path).st_mtime_ns == mtime  # untouched
    with open(path, "a") as f:
        f.write(json.dumps({"step": 4}) + "\n" + "not json\n" + '{"step": 5, "tr')
    with caplog.at_level(logging.INFO, logger="metrics"):
        assert drop_rows_after(path, 3) == 3
    assert rows(path) == [1, 2, 3] and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temp file left
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: dropped 3 row(s) after step 3, the step this run resumes from (they are logged again)"]


@pytest.mark.parametrize("override, words", [
    ("model.attention=flash_attn", "model.attention=flash_attn needs CUDA and the flash_attn package"),
    ("model.norm=te", "model.norm=te needs CUDA and transformer_engine"),
])
def test_a_kernel_missing_here_is_one_line_before_anything_runs(tmp_path, override, words):
    """A named attention/norm kernel this machine lacks: one line and exit 2 before the planner measures
    anything (it was a RuntimeError traceback from inside the compute profile, exit 1)."""
    proc = train(tmp_path / "run", override, "trainer.max_steps=1", check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines[-1].startswith("input error: "), proc.stderr[-2000:]
    assert words in lines[-1] and "Traceback" not in proc.stderr and "compute profile" not in proc.stderr
