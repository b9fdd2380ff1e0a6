"""model.compile=auto on CUDA: train.py's startup times one block eager and compiled on the GPU and keeps
the compiled blocks only where they win (amsp/compile_choice.py). Here: the measurement runs on CUDA in
bf16, is cached, and the config comes back decided the way the timings say."""
from __future__ import annotations

import pytest

from amsp.compile_choice import measure_choice, resolve_auto_compile
from amsp.launch import DistEnv
from amsp.planner.__main__ import compose_config
from configs.schema import to_llama_config

pytestmark = pytest.mark.gpu


def test_auto_compile_is_decided_by_timings_on_cuda(tmp_path):
    cfg = compose_config(["model=debug", "model.dim=512", "model.n_heads=8", "model.n_kv_heads=4",
                          "model.max_seq_len=512", "data.seq_len=512", "trainer.micro_batch_size=2", f"amsp.planner.cache_dir={tmp_path}"])
    choice = measure_choice(to_llama_config(cfg.model), 512, 2, "bf16", "cuda", tmp_path)
    assert choice.eager_s > 0 and choice.compiled_s > 0 and "measured on" in choice.source
    single = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
    decided = resolve_auto_compile(cfg, single, "cuda")  # reads the cached choice just written
    assert decided.model.compile == ("auto" if choice.compile else "off")
