"""trainer.init_from: a fresh run from a Hugging Face folder or from another run's checkpoint.

A transformers LlamaForCausalLM with random weights is saved locally (no download) in the shape of
tests/training/runs.py's debug model, with a tokenizer.json made locally that also tokenizes the runs'
corpus (data.tokenizer=DIR/tokenizer.json); train.py starting from it logs, as its first loss, transformers'
loss on the same first global batch (fp32, 1e-5), on 1 rank and on 4 ranks with a sharded plan; the
run's export loads in transformers with logits within 1e-4 of ours. A run initialised from another
run's checkpoint starts at step 0 with a fresh optimizer. Bad sources are one line and exit 2.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.training.runs import losses, train

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The HF model in the shape of runs.BASE's model (model=debug) with the vocabulary of the local
# tokenizer.json (600 pieces, padded to 640): dim 64, 2 layers, 4 heads, 2 kv heads, SwiGLU width 192
# (multiple_of=32), max_seq_len 256.
VOCAB = 640
HF_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=192, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
FAST = ["trainer.checkpoint_interval=0", "trainer.dtype=fp32", "trainer.device=cpu", f"model.vocab_size={VOCAB}",
        "data.valid_samples=8"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """A random-weight LlamaForCausalLM saved as safetensors (norm gains perturbed so a swapped
    norm mapping would show), with a tokenizer.json made locally."""
    from tests.tokenizer_files import make_tokenizer_json

    out = tmp_path_factory.mktemp("hf_model")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE, initializer_range=0.05))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer_json(out / "tokenizer.json", vocab_size=600)
    return out


@pytest.fixture(scope="module")
def corpus(hf_dir, tmp_path_factory) -> pathlib.Path:
    """A small JSONL corpus preprocessed with the HF folder's tokenizer.json (data.prefix)."""
    from data.preprocess import preprocess
    from tests.tokenizer_files import training_texts

    out = tmp_path_factory.mktemp("corpus")
    (out / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in training_texts() if t))
    preprocess([str(out / "docs.jsonl")], str(out / "docs"), str(hf_dir / "tokenizer.json"), progress=False)
    return out / "docs"


def data_overrides(hf_dir: pathlib.Path, corpus: pathlib.Path) -> list[str]:
    """The runs read the corpus tokenized with the HF folder's own tokenizer.json."""
    return [f"data.prefix={corpus}", f"data.tokenizer={hf_dir}/tokenizer.json"]


def first_global_batch(run_dir: pathlib.Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of step 1 of the run, rebuilt from its saved config the way train.py reads them."""
    from data.loader import MicroBatchLoader
    from data.pipeline import build_data

    cfg = OmegaConf.load(run_dir / "config.yaml")
    seed = cfg.trainer.seed if cfg.data.seed is None else cfg.data.seed
    gbs, mbs = cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size
    data = build_data(cfg.data, seq_len=cfg.data.seq_len, seed=seed, train_samples=cfg.trainer.max_steps * gbs,
                      model_vocab_size=cfg.model.vocab_size)
    loader = MicroBatchLoader(data.train, gbs, mbs, rank=0, world=1)
    try:
        parts = [next(loader) for _ in range(gbs // mbs)]
    finally:
        loader.close()
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def hf_loss(hf_model_dir: pathlib.Path, x: torch.Tensor, y: torch.Tensor) -> float:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def our_model(ckpt: pathlib.Path):
    from models.llama import build_model
    from models.llama.export_hf import load_model_state, read_saved_config, resolve_checkpoint_dir

    path = resolve_checkpoint_dir(ckpt)
    cfg, _ = read_saved_config(path)
    model = build_model(cfg)
    model.load_state_dict(load_model_state(path, cfg), strict=False)  # rotary tables are not saved
    return model.eval()


def first_loss(run_dir: pathlib.Path) -> float:
    return losses(run_dir)[1]


def stdout_lines(proc) -> str:
    return proc.stdout + proc.stderr


def test_import_then_export_is_bit_identical(hf_dir, tmp_path):
    from safetensors.torch import load_file

    from models.llama.export_hf import export
    from models.llama.import_hf import import_hf

    import_hf(hf_dir, tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "hf_again")
    before = load_file(str(hf_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "hf_again" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert (tmp_path / "hf_again" / "tokenizer.json").is_file()  # the folder's tokenizer travels along
    for name, t in before.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], t), name


@pytest.fixture(scope="module")
def run_from_hf(hf_dir, corpus, tmp_path_factory) -> tuple[pathlib.Path, str]:
    """One rank, 2 steps from the HF folder (shared by the tests below: train.py runs cost seconds)."""
    run = tmp_path_factory.mktemp("runs") / "from_hf"
    proc = train(run, f"trainer.init_from={hf_dir}", "trainer.max_steps=2", *FAST, *data_overrides(hf_dir, corpus))
    return run, stdout_lines(proc)


def test_init_from_hf_one_rank_matches_transformers_and_exports(hf_dir, run_from_hf, tmp_path):
    run, output = run_from_hf
    assert f"initialised weights from HF folder {hf_dir}" in output
    x, y = first_global_batch(run)
    assert abs(first_loss(run) - hf_loss(hf_dir, x, y)) < 1e-5

    # Fresh optimizer and step count: the checkpoint holds this run's 2 steps only.
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["optimizer_steps"] == 2

    # After training: the export loads in transformers and computes our logits.
    from models.llama.export_hf import export

    export(run, tmp_path / "exported")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = our_model(run)(x[:2]), hf(input_ids=x[:2]).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # Training moved the weights: the exported model is not the source.
    assert abs(hf_loss(tmp_path / "exported", x, y) - first_loss(run)) > 1e-4


# Slow (the suite's time budget): the default run keeps the one-rank import against transformers, the
# tensor-parallel import and test_every_rank_fills_exactly_its_shards (every rank's shards of a sharded plan).
@pytest.mark.slow
def test_init_from_hf_four_ranks_sharded_plan(hf_dir, corpus, tmp_path):
    """One spawned 4-rank run: parameters sharded 4 ways (ZeRO-3), every rank fills only its slices."""
    run = tmp_path / "from_hf_4"
    train(run, f"trainer.init_from={hf_dir}", "trainer.max_steps=1", "amsp.plan=zero3", *FAST,
          *data_overrides(hf_dir, corpus), nproc=4)
    x, y = first_global_batch(run)
    assert abs(first_loss(run) - hf_loss(hf_dir, x, y)) < 1e-5


@pytest.mark.slow  # one more 4-rank launch; the fast suite keeps the data-parallel one above
def test_init_from_hf_tensor_parallel(hf_dir, corpus, tmp_path):
    """tp=2 x dp=2: each rank fills its TP shard of every matrix from the full HF tensors."""
    run = tmp_path / "from_hf_tp2"
    train(run, f"trainer.init_from={hf_dir}", "trainer.max_steps=1", "amsp.plan=zero3", "parallel.tp=2", *FAST,
          *data_overrides(hf_dir, corpus), nproc=4)
    x, y = first_global_batch(run)
    assert abs(first_loss(run) - hf_loss(hf_dir, x, y)) < 1e-5


def _fill_on_plans(rank: int, world: int, hf_dir: str) -> list[tuple[str, float, float]]:
    """Per (plan, precision): the largest difference between this rank's fp32 masters and the HF
    weights (in our layout), and between its P shard and the weights rounded to the compute dtype."""
    from amsp.engine import AMSPEngine, EngineOptions
    from amsp.init_from import load_into_engine, open_source
    from amsp.plan import Degrees, Plan
    from amsp.topology import Topology

    src = open_source(hf_dir)
    cases = [("zero3 fp32", Plan(Degrees(2, 2, 2), Degrees(2, 2, 2)), "fp32"),
             ("ddp blocks, zero2 embed/head, bf16", Plan(Degrees(1, 1, 1), Degrees(1, 2, 2)), "bf16")]
    out = []
    for name, plan, precision in cases:
        eng = AMSPEngine(src.config, plan, Topology(world, world), rank, seed=7,
                         options=EngineOptions(precision=precision))
        load_into_engine(eng, src)
        master_err = max((f.master - src.read(f.name).reshape(-1)[f.start:f.end]).abs().max().item()
                         for f in eng.named_fragments())
        p_err = 0.0
        for u in eng.units:
            lo, hi = u.layout.p_range(rank)
            for s in u.slots:
                a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
                if a < b:
                    want = src.read(s.name).reshape(-1)[a - s.offset:b - s.offset].to(u.compute_dtype)
                    p_err = max(p_err, (u.p_shard[a - lo:b - lo] - want).abs().max().item())
        out.append((name, master_err, p_err))
    return out


@pytest.mark.slow  # ~30 s on 2 shared cores; the 4-rank train.py run above covers a sharded fill in CI
def test_every_rank_fills_exactly_its_shards(hf_dir):
    """Two ranks, two plans, fp32 and bf16 (where the master is a tensor of its own): the masters hold
    the source's fp32 values and the P shards their rounding, bit for bit."""
    from tests.distributed import run_distributed

    for per_rank in run_distributed(_fill_on_plans, 2, str(hf_dir)):
        for name, master_err, p_err in per_rank:
            assert master_err == 0.0 and p_err == 0.0, name


def test_init_from_run_checkpoint_starts_fresh(hf_dir, corpus, run_from_hf, tmp_path):
    """Run B starts from run A's run directory (its newest verified checkpoint): B's first loss is A's
    final weights on B's first batch, at step 1 of B, and B's optimizer starts over. Rerunning B
    resumes B: init_from is then ignored and said so."""
    run_a, run_b = run_from_hf[0], tmp_path / "b"
    proc = train(run_b, f"trainer.init_from={run_a}", "trainer.max_steps=1", *FAST, *data_overrides(hf_dir, corpus))
    assert "initialised weights from checkpoint" in stdout_lines(proc)
    x, y = first_global_batch(run_b)
    with torch.no_grad():
        a_loss = our_model(run_a)(x, y).item()
    assert abs(first_loss(run_b) - a_loss) < 1e-5
    meta = json.loads((run_b / "checkpoints" / "step_00000001" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["optimizer_steps"] == 1


@pytest.mark.slow  # two more train.py runs (~20 s)
def test_resume_wins_over_init_from(hf_dir, corpus, run_from_hf, tmp_path):
    """A requeued run with init_from continues from its own checkpoint (step 2 follows step 1) and
    says that init_from is ignored."""
    run_a, run_b = run_from_hf[0], tmp_path / "b"
    train(run_b, f"trainer.init_from={run_a}", "trainer.max_steps=1", *FAST, *data_overrides(hf_dir, corpus))
    first = losses(run_b)[1]
    proc = train(run_b, f"trainer.init_from={run_a}", "trainer.max_steps=2", *FAST, *data_overrides(hf_dir, corpus))
    assert "is ignored because the run resumes" in stdout_lines(proc)
    assert sorted(losses(run_b)) == [1, 2] and losses(run_b)[1] == first
    meta = json.loads((run_b / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["optimizer_steps"] == 2


def test_bad_sources_are_named_before_anything_is_built(hf_dir, tmp_path):
    """In process (fast): the config check names a missing path and a folder of neither kind; a model
    of other shapes names each differing field and the overrides to set."""
    from dataclasses import replace

    from hydra import compose, initialize_config_dir

    from amsp.errors import InputError
    from amsp.init_from import check_matches, open_source
    from configs.schema import register_configs
    from configs.validate import ConfigError, validate_config
    from tests.training.runs import ROOT

    register_configs()
    (tmp_path / "empty").mkdir()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        for src, want in ((tmp_path / "nope", "does not exist"),
                          (tmp_path / "empty", "is neither a Hugging Face model folder")):
            with pytest.raises(ConfigError, match=want):
                validate_config(compose(config_name="train", overrides=[f"trainer.init_from={src}"]))
        validate_config(compose(config_name="train", overrides=[f"trainer.init_from={hf_dir}"]))
    src = open_source(hf_dir)
    check_matches(src, src.config)
    with pytest.raises(InputError) as e:
        check_matches(src, replace(src.config, dim=128, n_layers=3, multiple_of=256))
    msg = str(e.value)
    assert "dim=128 (source 64), n_layers=3 (source 2), ffn_hidden_dim=512 (source 192)" in msg, msg
    assert "set model.dim=64 model.n_layers=2 model.multiple_of=192 model.ffn_dim_multiplier=null" in msg, msg
    assert "\n" not in msg


@pytest.mark.slow  # the same through train.py: exit codes and one stderr line (~30 s)
@pytest.mark.parametrize("case", ["missing", "neither", "shape"])
def test_bad_init_from_is_one_line_input_error(hf_dir, corpus, tmp_path, case):
    if case == "missing":
        src, extra, want = tmp_path / "nope", [], "does not exist"
    elif case == "neither":
        (tmp_path / "empty").mkdir()
        src, extra, want = tmp_path / "empty", [], "is neither a Hugging Face model folder"
    else:  # the run's model has 3 layers and 128-wide embeddings, the folder 2 and 64
        src, extra, want = hf_dir, ["model.n_layers=3", "model.dim=128"], "set model.dim=64 model.n_layers=2"
    proc = train(tmp_path / "run", f"trainer.init_from={src}", *extra, *FAST, *data_overrides(hf_dir, corpus),
                 check=False)
    assert proc.returncode == 2, stdout_lines(proc)[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "init_from" in ln]
    assert len(errors) == 1 and want in errors[0], proc.stderr[-3000:]


def damage(run: pathlib.Path, case: str) -> tuple[pathlib.Path, str]:
    """Damage the run's only checkpoint as a disk or a copy can: (the file to name, what to say about it)."""
    from tests.training.test_checkpoint_faults import flip_bit

    step = run / "checkpoints" / "step_00000002"
    if case == "flip":  # one bit in a stored weight
        return flip_bit(step, "model.layers.0.attention.wq.weight"), "checksum mismatch in model.layers.0"
    if case == "metadata":  # a torn .metadata
        os.truncate(step / ".metadata", 100)
        return step / ".metadata", "unreadable (UnpicklingError"
    shutil.rmtree(step / "checksums")  # meta.json says the save was checksummed
    return step / "checksums", "missing (meta.json says the save was checksummed)"


@pytest.mark.parametrize("case", ["flip", "metadata", "manifests"])
@pytest.mark.parametrize("given", ["step", "run"])
def test_damaged_checkpoint_source_is_a_fault_naming_the_file(run_from_hf, tmp_path, case, given):
    """In process (fast): a damaged checkpoint is a CheckpointDamaged (the fault resume gives, exit 3)
    naming the file, given its step directory or the run directory. Before, the bit flip was DCP's
    CheckpointException, the torn .metadata an UnpicklingError (tracebacks, exit 1) and the missing
    manifests were not noticed: the weights were read unverified."""
    from amsp.checkpoint_verify import CheckpointDamaged
    from amsp.init_from import open_source

    run = shutil.copytree(run_from_hf[0], tmp_path / "a")
    where, want = damage(run, case)
    with pytest.raises(CheckpointDamaged) as e:
        src = open_source(run if given == "run" else run / "checkpoints" / "step_00000002")
        for name in src.names:
            src.read(name)
    msg = str(e.value)
    assert msg.startswith("trainer.init_from=") and f"{where}: {want}" in msg and "\n" not in msg, msg


@pytest.mark.slow  # the same through train.py: the exit code and the one stderr line (~10 s)
def test_damaged_init_from_is_one_line_fault(hf_dir, corpus, run_from_hf, tmp_path):
    run = shutil.copytree(run_from_hf[0], tmp_path / "a")
    where, want = damage(run, "flip")
    proc = train(tmp_path / "b", f"trainer.init_from={run}", "trainer.max_steps=1", *FAST,
                 *data_overrides(hf_dir, corpus), check=False)
    assert proc.returncode == 3, stdout_lines(proc)[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "init_from" in ln]
    assert len(errors) == 1 and errors[0].startswith("fault: trainer.init_from=") and f"{where}: {want}" in errors[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
