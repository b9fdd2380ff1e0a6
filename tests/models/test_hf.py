"""Hugging Face export/import: transformers' LlamaForCausalLM reproduces our logits (rotary
permutation), the export -> import round trip is bitwise lossless, the tokenizer loads, and
bad inputs are named. Everything is local: no download."""
import json
import os
import pathlib
import shutil
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from amsp.checkpoint_verify import CheckpointDamaged
from models.llama import LlamaConfig, RopeScaling, build_model
from models.llama.export_hf import export, load_model_state
from models.llama.hf import halves_to_interleaved, interleaved_to_halves
from models.llama.import_hf import import_hf
from models.llama.model import apply_rope, rope_tables

transformers = pytest.importorskip("transformers")
# The test writes its checkpoints in one process without a process group, as intended.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BASE = dict(dim=64, n_layers=2, n_heads=4, vocab_size=96, multiple_of=32, max_seq_len=64)
CONFIGS = {
    "untied_mha": LlamaConfig(**BASE),
    "tied_gqa": LlamaConfig(**BASE, n_kv_heads=2, tie_embeddings=True, norm_eps=1e-6),
    "gqa_llama3_rope": LlamaConfig(**{**BASE, "max_seq_len": 128}, n_kv_heads=1, ffn_dim_multiplier=1.3,
                                   rope_theta=500000.0,
                                   rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32)),
}


def random_weights(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    model = build_model(cfg, seed=seed)
    with torch.no_grad():  # norms start at 1: perturb them so a swapped norm mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def config_yaml(cfg: LlamaConfig, tokenizer=None) -> str:
    node = {"model": {"name": "unit", **asdict(cfg)}, "trainer": {"max_steps": 1}}
    if tokenizer:
        node["data"] = {"tokenizer": str(tokenizer)}
    return OmegaConf.to_yaml(OmegaConf.create(node))


def write_checkpoint(ckpt_dir: pathlib.Path, cfg: LlamaConfig, seed: int, tokenizer=None) -> dict:
    """The agreed checkpoint format, written independently of import_hf: DCP entries
    model.<name> as flat fp32 tensors plus the resolved config.yaml."""
    state = random_weights(cfg, seed)
    entries = {f"model.{n}": t.reshape(-1) for n, t in state.items()}
    # A training checkpoint also holds optimizer state and scalars; export must read past them.
    entries.update({"optim.exp_avg.tok_embeddings.weight": torch.ones(3), "step": 7})
    dcp.save(entries, checkpoint_id=str(ckpt_dir), no_dist=True)
    (ckpt_dir / "config.yaml").write_text(config_yaml(cfg, tokenizer))
    return state


def our_logits(cfg: LlamaConfig, state: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg)
    model.load_state_dict(state, strict=False)  # rotary tables are non-persistent buffers
    with torch.no_grad():
        return model(tokens)


def hf_logits(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, local_files_only=True)
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits


def test_rotary_permutation_maps_interleaved_pairs_to_halves():
    heads, hd, dim = 2, 8, 16
    w = torch.randn(heads * hd, dim)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, heads), heads), w)
    cfg = LlamaConfig(dim=heads * hd, n_heads=heads, n_layers=1, vocab_size=8)
    cos, sin = rope_tables(cfg, 5)
    x = torch.randn(1, 5, dim)
    ours = apply_rope((x @ w.T).view(1, 5, heads, hd), cos, sin)
    # HF's rotate_half convention on the permuted weights gives the same rotation, permuted.
    q = (x @ interleaved_to_halves(w, heads).T).view(1, 5, heads, hd)
    c, s = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    theirs = q * c + torch.cat([-q[..., hd // 2:], q[..., :hd // 2]], -1) * s
    perm = interleaved_to_halves(torch.arange(heads * hd, dtype=torch.float32)[:, None], heads).long().view(-1)
    assert torch.allclose(ours.reshape(1, 5, -1)[..., perm], theirs.reshape(1, 5, -1), atol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_matches_transformers_and_round_trip_is_bitwise(tmp_path, name):
    cfg = CONFIGS[name]
    ckpt, hf_dir, back = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "back"
    ckpt.mkdir()
    state = write_checkpoint(ckpt, cfg, seed=3)
    export(ckpt, hf_dir)
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    assert hf_cfg["num_key_value_heads"] == cfg.n_kv_heads and hf_cfg["rope_theta"] == cfg.rope_theta
    assert hf_cfg["tie_word_embeddings"] == cfg.tie_embeddings
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    ours, theirs = our_logits(cfg, state, tokens), hf_logits(hf_dir, tokens)
    assert (ours - theirs).abs().max().item() < 1e-4

    import_hf(hf_dir, back)
    saved = OmegaConf.to_container(OmegaConf.load(back / "config.yaml"))["model"]
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta",
              "max_seq_len", "tie_embeddings"):
        assert saved[f] == getattr(cfg, f), f
    assert saved["rope_scaling"] == asdict(cfg.rope_scaling)
    restored = load_model_state(back, cfg)
    assert restored.keys() == state.keys()
    for k in state:
        assert torch.equal(restored[k], state[k]), k
    # And a second export of the imported checkpoint writes the same weights bit for bit.
    export(back, tmp_path / "hf2")
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (hf_dir / "model.safetensors").read_bytes()


def test_import_of_a_transformers_written_model(tmp_path):
    hcfg = transformers.LlamaConfig(vocab_size=80, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                    rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hcfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "ckpt" / "config.yaml"))["model"]
    cfg = LlamaConfig(**{k: v for k, v in saved.items() if k not in ("name", "rope_scaling")},
                      rope_scaling=RopeScaling(**saved["rope_scaling"]))
    assert cfg.ffn_hidden_dim == 100 and cfg.n_kv_heads == 2
    tokens = torch.randint(0, 80, (1, 40), generator=torch.Generator().manual_seed(1))
    ours = our_logits(cfg, load_model_state(tmp_path / "ckpt", cfg), tokens)
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_tokenizer_is_exported_for_llama_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=64,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    cfg = LlamaConfig(**{**BASE, "vocab_size": 64})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, cfg, seed=1, tokenizer=tmp_path / "sp.model")
    export(ckpt, tmp_path / "hf")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (1, 2)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    text = "the lazy fox jumps 12"
    # No BOS: training saw documents as their ids then EOS (data/tok_base.py).
    assert tok(text)["input_ids"] == sp.encode(text)
    assert tok(" " + text)["input_ids"] == sp.encode(" " + text)
    import_hf(tmp_path / "hf", tmp_path / "back")
    saved = OmegaConf.load(tmp_path / "back" / "config.yaml")
    assert pathlib.Path(saved.data.tokenizer).read_bytes() == (tmp_path / "sp.model").read_bytes()
    # A checkpoint whose config names no tokenizer takes one from the command line.
    bare = tmp_path / "bare"
    bare.mkdir()
    write_checkpoint(bare, cfg, seed=1)
    export(bare, tmp_path / "hf3", tokenizer=tmp_path / "sp.model")
    assert (tmp_path / "hf3" / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()


def test_bad_inputs_are_named(tmp_path):
    cfg = CONFIGS["untied_mha"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, cfg, seed=0)
    # A config that does not describe the stored weights.
    node = OmegaConf.load(ckpt / "config.yaml")
    node.model.n_layers = 3
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(node))
    with pytest.raises(ValueError, match="missing \\['layers.2"):
        export(ckpt, tmp_path / "hf")
    (ckpt / "config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        export(ckpt, tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        load_model_state(tmp_path, cfg)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                                                  "num_hidden_layers": 1, "intermediate_size": 192,
                                                                  "vocab_size": 10}))
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pickled"):
        import_hf(tmp_path / "pickled", tmp_path / "out")
    bias = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 192,
            "vocab_size": 10, "attention_bias": True}
    (tmp_path / "pickled" / "config.json").write_text(json.dumps(bias))
    with pytest.raises(ValueError, match="attention_bias=True"):
        import_hf(tmp_path / "pickled", tmp_path / "out")


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned > /dev/null",))


def test_latest_pointer_and_tampered_metadata(tmp_path):
    import pickle

    cfg = CONFIGS["untied_mha"]
    step = tmp_path / "run" / "checkpoints" / "step_00000005"
    step.mkdir(parents=True)
    write_checkpoint(step, cfg, seed=2)
    (step.parent / "latest").write_text("step_00000005\n")
    export(tmp_path / "run", tmp_path / "hf")  # a run directory resolves through checkpoints/latest
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    (step / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointDamaged, match="UnpicklingError: .*(posix.system|os.system)"):
        load_model_state(step, cfg)
    (step.parent / "latest").write_text("step_00000009\n")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        export(tmp_path / "run", tmp_path / "hf2")


def test_export_verifies_the_trainers_checksums(tmp_path, capsys):
    """A checkpoint the trainer wrote (checksums/, meta.json, the `verified` mark) is checked as resume
    checks it: a flipped bit in a stored weight, a truncated .metadata or a deleted checksums/ (meta.json
    says the save was checksummed) is one line naming the file, exit 3 (a fault: amsp/errors.py), and
    nothing is exported. Before, the first exported wrong weights, the second was a traceback and the
    third exported unverified."""
    from amsp.checkpoint import CheckpointManager, Fragment
    from models.llama.export_hf import main
    from tests.training.test_checkpoint_faults import flip_bit

    cfg = CONFIGS["untied_mha"]
    state = random_weights(cfg, seed=4)
    CheckpointManager(tmp_path / "run").save(1, [Fragment(f"model.{n}", tuple(t.shape), (0,) * t.dim(), t)
                                                 for n, t in state.items()], {}, {}, config_yaml(cfg))
    assert main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0  # intact: exported
    assert main([str(tmp_path / "no_such_run"), str(tmp_path / "hf_none")]) == 2  # input error, as errors.py says
    restored = load_model_state(tmp_path / "run", cfg)
    assert all(torch.equal(restored[k], state[k]) for k in state)
    want = {"flip": "checksum mismatch in model.layers.0.attention.wq.weight", "metadata": "unreadable",
            "manifests": "missing (meta.json says the save was checksummed)"}
    for case in want:
        run = shutil.copytree(tmp_path / "run", tmp_path / case)
        step = run / "checkpoints" / "step_00000001"
        if case == "flip":
            where = flip_bit(step, "model.layers.0.attention.wq.weight")
        elif case == "metadata":
            where = step / ".metadata"
            os.truncate(where, 100)
        else:
            where = step / "checksums"
            shutil.rmtree(where)
        capsys.readouterr()
        assert main([str(run), str(tmp_path / f"hf_{case}")]) == 3, case
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"fault: {where}: ") and want[case] in err and "\n" not in err, err
        assert not (tmp_path / f"hf_{case}" / "model.safetensors").exists(), case
