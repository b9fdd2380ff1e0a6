"""train.py on the built-in corpus: the loss falls clearly below the corpus's unigram entropy.

A smaller built-in corpus (1.5 MB, 1000 BPE pieces) and the debug model keep this quick; it is
cached under .cache/ like the default one. The default `make train` configuration is the slow test.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model=debug", "model.vocab_size=1024", "data.builtin.max_bytes=1500000", "data.builtin.vocab_size=1000",
         "data.seq_len=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "optim.lr=3e-3",
         "optim.warmup_steps=10", "logging.wandb.mode=disabled"]


def train(tmp_path, *overrides, timeout=900):
    cmd = [sys.executable, "train.py", f"trainer.output_dir={tmp_path}", *overrides]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    entropy = float(re.search(r"unigram entropy of the training tokens: ([0-9.]+) nats", r.stdout).group(1))
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", r.stdout)]
    return entropy, losses


def test_loss_falls_below_unigram_entropy(tmp_path):
    entropy, losses = train(tmp_path, *SMALL, "trainer.max_steps=80", "trainer.log_interval=20")
    assert len(losses) == 4
    assert losses[0] > losses[-1]
    assert losses[-1] < entropy - 0.4, (losses, entropy)


def test_data_errors_stop_train_before_training(tmp_path):
    cmd = [sys.executable, "train.py", f"trainer.output_dir={tmp_path}", "model=debug",
           f"data.prefix={tmp_path}/missing", "data.tokenizer=/nonexistent/tok.model", "logging.wandb.mode=disabled"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "/nonexistent/tok.model: tokenizer model not found" in r.stdout + r.stderr
    assert "| loss " not in r.stdout  # no training step ran


@pytest.mark.slow
def test_make_train_default_config_learns_the_builtin_corpus(tmp_path):
    """The default configuration (what `make train` runs) ends clearly below the unigram entropy."""
    entropy, losses = train(tmp_path, "logging.wandb.mode=disabled", timeout=1800)
    assert losses[-1] < entropy - 1.0, (losses, entropy)
