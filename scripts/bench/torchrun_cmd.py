"""The torchrun command line the benches launch their 4-rank runs with, logging under the bench's own work
folder: torchrun's default log folder is a fresh /tmp/torchelastic_* per launch that nothing removes
(a capped memory bench leaves ~65 of them)."""
from __future__ import annotations

import sys
import tempfile


def torchrun_cmd(nproc: int, argv: list[str], work: str) -> list[str]:
    """`python -m torch.distributed.run --standalone` on `nproc` local ranks running `argv`, with
    `--log-dir` a new folder in `work`, which the caller removes with its work folder."""
    logs = tempfile.mkdtemp(prefix="torchrun-logs-", dir=work)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--log-dir={logs}", *argv]
