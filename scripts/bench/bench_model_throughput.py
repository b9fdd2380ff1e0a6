"""Forward + backward tokens/s of our LLaMA against transformers' LlamaForCausalLM, same config.

Both models are built from one shape (random weights, nothing downloaded), run in the same dtype
with the same thread count on the same batch, and are timed alternately (ours, theirs, ours, ...)
in one process so machine noise hits both alike. The loss is the same function for both (our
lm_loss on the logits), so the timed work is: embedding, blocks, head, cross-entropy, backward.

    python scripts/bench/bench_model_throughput.py --threads 2 --rounds 6
    python scripts/bench/bench_model_throughput.py --profile ours   # where the time goes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from models.llama import LlamaConfig, build_model, lm_loss  # noqa: E402


def bench_config(args) -> LlamaConfig:
    return LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                       vocab_size=args.vocab, multiple_of=256, max_seq_len=max(args.seq, 256), attention="sdpa",
                       norm="torch")


def build_hf(cfg: LlamaConfig, dtype: torch.dtype, seed: int):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf_cfg = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden_dim,
                      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                      num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                      rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
                      attention_bias=False, mlp_bias=False, use_cache=False)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_cfg).to(dtype)
    model.train()
    return model


def make_steps(cfg, args, dtype):
    ours = build_model(cfg, dtype=dtype, seed=args.seed)
    ours.train()
    theirs = build_hf(cfg, dtype, args.seed)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_theirs = sum(p.numel() for p in theirs.parameters())
    if n_ours != n_theirs:
        raise SystemExit(f"parameter counts differ: ours {n_ours}, transformers {n_theirs}")
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step_ours():
        loss = ours(x, y)
        loss.backward()
        ours.zero_grad(set_to_none=True)

    def step_theirs():
        loss = lm_loss(theirs(input_ids=x).logits, y)
        loss.backward()
        theirs.zero_grad(set_to_none=True)

    return {"ours": step_ours, "transformers": step_theirs}, n_ours


def timed(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def profile(fn, name: str, steps: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    with prof(activities=[ProfilerActivity.CPU], record_shapes=False) as p:
        for _ in range(steps):
            fn()
    print(f"== profile of {name} ({steps} steps), top {top} ops by self CPU time ==")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=6, help="alternations; each times --steps steps per model")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", choices=("ours", "transformers", "both"))
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = bench_config(args)
    steps, n_params = make_steps(cfg, args, dtype)
    tokens = args.batch * args.seq
    if args.profile:
        for name in (("ours", "transformers") if args.profile == "both" else (args.profile,)):
            profile(steps[name], name, args.steps, args.profile_top)
        return
    for fn in steps.values():  # warm-up: allocator, SDPA kernel choice
        fn()
    per: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            per[name].append(timed(steps[name], args.steps))
    result = {"params": n_params, "tokens_per_step": tokens, "threads": args.threads, "dtype": args.dtype,
              "shape": {"dim": cfg.dim, "layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                        "vocab": cfg.vocab_size, "ffn": cfg.ffn_hidden_dim, "batch": args.batch, "seq": args.seq},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "results": {}}
    for name, ts in per.items():
        med = statistics.median(ts)
        result["results"][name] = {"median_step_s": round(med, 4), "tokens_per_s": round(tokens / med, 1),
                                   "step_s_all": [round(t, 4) for t in ts]}
    result["ours_over_transformers"] = round(
        result["results"]["ours"]["tokens_per_s"] / result["results"]["transformers"]["tokens_per_s"], 3)
    # Per-round ratio (side by side), less sensitive to drift in machine load than the medians.
    ratios = [t / o for o, t in zip(per["ours"], per["transformers"])]
    result["ours_over_transformers_per_round_median"] = round(statistics.median(ratios), 3)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
