"""train.py end to end: a short run whose loss falls (its config errors: tests/test_config_validate.py)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, *overrides, timeout=300):
    cmd = [sys.executable, "train.py", f"trainer.output_dir={tmp_path}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"\| loss ([0-9.]+)", stdout)]


def test_short_run_loss_falls_and_config_is_saved(tmp_path):
    r = run_train(tmp_path, "model=debug", "trainer.max_steps=40", "trainer.log_interval=10",
                  "data.seq_len=64", "trainer.run_name=e2e")
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    ls = losses(r.stdout)
    assert len(ls) == 4 and ls[-1] < ls[0] - 0.5, ls
    saved = (tmp_path / "e2e" / "config.yaml").read_text()
    assert "max_steps: 40" in saved


def test_validation_runs_without_autograd():
    """evaluate() must not build graphs (the engine's forward registers backward hooks when grad is on)."""
    import torch

    from train import evaluate

    class Engine:
        seen = []

        def evaluate(self, x, y):
            self.seen.append(torch.is_grad_enabled())
            return torch.tensor(2.0)

    eng = Engine()
    assert evaluate(eng, [(torch.zeros(1), torch.zeros(1))] * 2) == 2.0
    assert eng.seen == [False, False]
