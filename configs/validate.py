"""Every numeric and enum field of the training config, checked before any state exists.

Hydra's schema already rejects unknown keys and wrong types; this adds the ranges and choices a
type cannot say (a negative or NaN learning rate, a zero micro-batch, an unknown dtype), so a
mistyped override stops the run in its first second with one line that names the key, the value
and what is allowed, instead of a ZeroDivisionError or a silent NaN checkpoint steps later.
Fields a run may add that are not listed here are left to their own component's checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from amsp.parallel.micro_batches import SCHEDULES, virtual_stages_problem

# What trainer.allow_resume_changes may name (data/resume_check.py acts on them).
RESUME_CHANGES = ("seq_len", "tokenizer", "data", "model", "schedule")
# The built-in corpus's smallest tokenizer: 256 byte pieces, the special pieces and every character the corpus
# needs (sentencepiece counts 349 for the stdlib); below that its training fails with an INTERNAL error after the
# corpus was extracted. The same floor data/pipeline.py holds the default vocabulary to (_BUILTIN_MIN_VOCAB).
BUILTIN_MIN_VOCAB = 384


class ConfigError(ValueError):
    """A config value outside what is allowed; its message is one line meant for the user."""


@dataclass(frozen=True)
class Rule:
    key: str
    allowed: str  # how the error states what is allowed
    ok: Callable[[Any], bool]
    optional: bool = False  # None is allowed (the field's default meaning applies)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_at_least(key: str, low: int, optional: bool = False) -> Rule:
    return Rule(key, f"an integer >= {low}", lambda v: _int(v) and v >= low, optional)


def finite_at_least(key: str, low: float, strict: bool = False, optional: bool = False) -> Rule:
    if strict:
        return Rule(key, f"a finite number > {low:g}", lambda v: _number(v) and v > low, optional)
    return Rule(key, f"a finite number >= {low:g}", lambda v: _number(v) and v >= low, optional)


def in_unit_interval(key: str, optional: bool = False) -> Rule:
    return Rule(key, "a finite number in [0, 1)", lambda v: _number(v) and 0 <= v < 1, optional)


def in_closed_unit_interval(key: str, optional: bool = False) -> Rule:
    return Rule(key, "a finite number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1, optional)


def one_of(key: str, *choices: str) -> Rule:
    return Rule(key, "one of " + "|".join(choices), lambda v: v in choices)


RULES: tuple[Rule, ...] = (
    int_at_least("data.seq_len", 1),
    int_at_least("data.valid_samples", 0),
    int_at_least("data.pad_vocab_multiple", 1),
    int_at_least("data.prefetch", 0),
    int_at_least("data.seed", 0, optional=True),
    int_at_least("data.split_seed", 0),
    int_at_least("data.builtin.vocab_size", BUILTIN_MIN_VOCAB, optional=True),
    Rule("data.split", "two finite numbers >= 0 (train, validation) with a positive train share",
         lambda v: len(v) == 2 and all(_number(x) and x >= 0 for x in v) and v[0] > 0),
    finite_at_least("optim.lr", 0, strict=True),
    finite_at_least("optim.min_lr", 0, optional=True),
    Rule("optim.min_lr_ratio", "a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1, True),
    int_at_least("optim.warmup_steps", 0),
    int_at_least("optim.decay_steps", 1, optional=True),
    finite_at_least("optim.weight_decay", 0),
    in_unit_interval("optim.beta1"),
    in_unit_interval("optim.beta2"),
    finite_at_least("optim.eps", 0, strict=True),
    finite_at_least("optim.grad_clip", 0),
    int_at_least("trainer.max_steps", 1),
    int_at_least("trainer.micro_batch_size", 1),
    int_at_least("trainer.global_batch_size", 1),
    int_at_least("trainer.global_batch_tokens", 1, optional=True),
    int_at_least("trainer.seed", 0),
    one_of("trainer.device", "auto", "cpu", "cuda"),
    one_of("trainer.dtype", "auto", "fp32", "bf16"),
    int_at_least("trainer.log_interval", 1),
    int_at_least("trainer.threads", 1, optional=True),
    int_at_least("trainer.checkpoint_interval", 0),
    int_at_least("trainer.keep_last_checkpoints", 1),
    int_at_least("trainer.val_interval", 0),
    int_at_least("trainer.val_samples", 0),
    int_at_least("trainer.max_consecutive_skips", 1),
    finite_at_least("trainer.collective_timeout_s", 0, strict=True),
    Rule("trainer.allow_resume_changes", "a list of " + "|".join(RESUME_CHANGES),
         lambda v: isinstance(v, list) and all(x in RESUME_CHANGES for x in v)),
    one_of("logging.level", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    one_of("logging.wandb.mode", "online", "offline", "disabled"),
    finite_at_least("logging.peak_tflops", 0, strict=True, optional=True),
    one_of("amsp.precision", "auto", "fp32", "bf16"),
    one_of("amsp.grad_comm", "auto", "fp32", "bf16"),
    one_of("amsp.optimizer_kernel", "auto", "fused", "foreach", "csrc"),
    one_of("model.compile", "auto", "on", "off"),
    one_of("cluster.device", "cpu", "cuda"),
    # The launch's shape replaces them in a training run (logged); the planner CLI prices them as given.
    int_at_least("cluster.nodes", 1),
    int_at_least("cluster.ranks_per_node", 1),
    finite_at_least("cluster.device_memory_gib", 0, strict=True, optional=True),  # None: measured at startup
    finite_at_least("cluster.peak_tflops", 0, strict=True, optional=True),
    finite_at_least("cluster.memory_bandwidth_gbs", 0, strict=True),
    one_of("cluster.dtype", "fp32", "bf16"),  # Precision.named and the measured peak know these two
    finite_at_least("cluster.intra_latency_us", 0),
    finite_at_least("cluster.inter_latency_us", 0),
    finite_at_least("cluster.intra_bandwidth_gbs", 0, strict=True),
    finite_at_least("cluster.inter_bandwidth_gbs", 0, strict=True),
    in_closed_unit_interval("cluster.overlap_slowdown"),
    int_at_least("amsp.spread_window", 1),
    int_at_least("amsp.ranks_per_node", 1, optional=True),
    *(int_at_least(f"amsp.{k}", 1, optional=True)
      for k in ("p", "g", "os", "embed_head_p", "embed_head_g", "embed_head_os")),
    # The planner's own range checks (cost_model.Options, cluster.ClusterSpec), so a value they refuse is one
    # line here instead of a traceback once the run has started.
    Rule("amsp.planner.mfu", "a finite number in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    finite_at_least("amsp.planner.state_budget_gib", 0, strict=True, optional=True),
    in_unit_interval("amsp.planner.memory_margin", optional=True),
    finite_at_least("amsp.planner.reserved_gib", 0),
    int_at_least("amsp.planner.tp", 1),
    int_at_least("amsp.planner.pp", 1),
    in_closed_unit_interval("amsp.planner.overlap_slowdown", optional=True),
    int_at_least("amsp.planner.top_k", 1),
    finite_at_least("amsp.planner.probe_budget_s", 0, strict=True),
    int_at_least("amsp.planner.probe_max_mib", 1),
    int_at_least("amsp.planner.recheck_steps", 0),
    in_unit_interval("amsp.planner.replan_min_gain"),
    finite_at_least("amsp.planner.time_limit_s", 0, strict=True),
    int_at_least("parallel.tp", 1),
    int_at_least("parallel.pp", 1),
    one_of("parallel.schedule", *SCHEDULES),
    int_at_least("parallel.virtual_stages", 1),
    Rule("parallel.layer_split", "a list of integers >= 1 (layers per stage)",
         lambda v: isinstance(v, list) and len(v) >= 1 and all(_int(x) and x >= 1 for x in v), optional=True),
    int_at_least("debug.die_at_step", 1, optional=True),
    int_at_least("debug.die_rank", 0),
    int_at_least("debug.stop_at_step", 1, optional=True),
    int_at_least("debug.stop_rank", 0),
    Rule("debug.clock_skew_s", "a finite number", _number),
    int_at_least("debug.clock_skew_rank", 0, optional=True),
    Rule("debug.nan_loss_at_steps", "a list of integers >= 1", lambda v: all(_int(x) and x >= 1 for x in v)),
    # The model's sizes: a zero divides in the model's own shape rules (model_shape_problems), a negative
    # one fails inside torch; rope_theta or norm_eps <= 0 makes every step NaN.
    *(int_at_least(f"model.{k}", 1) for k in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of",
                                               "max_seq_len")),
    int_at_least("model.n_kv_heads", 1, optional=True),
    finite_at_least("model.rope_theta", 0, strict=True),
    finite_at_least("model.norm_eps", 0, strict=True),
    finite_at_least("model.ffn_dim_multiplier", 0, strict=True, optional=True),
)


def _describe(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def validate_config(cfg: DictConfig, what_if: bool = False) -> None:
    """Raise one ConfigError naming every field outside its allowed values.

    what_if: the planner CLI's pricing, where amsp.planner.tp / pp are what-if degrees; False (train.py): a
    training run, which plans under parallel.tp / pp."""
    problems = []
    for rule in RULES:
        value = OmegaConf.select(cfg, rule.key, default="__absent__")
        if value == "__absent__" or (value is None and rule.optional):
            continue
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        try:
            ok = rule.ok(value)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            problems.append(f"{rule.key}={_describe(value)} is not allowed: expected {rule.allowed}")
    problems += unknown_keys(cfg)
    problems += _cross_field_problems(cfg)
    problems += _planner_degree_problems(cfg, what_if)
    if not any(p.startswith("model.") for p in problems):  # its divisibility rules would divide by a bad size
        problems += model_shape_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def unknown_keys(cfg: DictConfig, where: str = "") -> list[str]:
    """Keys the schema (configs/schema.py) does not have. Hydra refuses `optim.lrr=1` but answers it with
    "To append to your config use +optim.lrr=1", and an appended key was then read by nothing: the value the
    user meant to set stayed at its default, silently."""
    import dataclasses

    out = []
    schema = OmegaConf.get_type(cfg) if isinstance(cfg, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return out
    known = {f.name for f in dataclasses.fields(schema)}
    for key in cfg.keys():
        name = f"{where}{key}"
        if key not in known:
            out.append(f"{name} is not a setting (misspelt? an appended +{name} is read by nothing)")
        elif isinstance(child := cfg._get_node(key), DictConfig):
            out += unknown_keys(child, f"{name}.")
    return out


def _cross_field_problems(cfg: DictConfig) -> list[str]:
    out = []
    lr, min_lr = OmegaConf.select(cfg, "optim.lr"), OmegaConf.select(cfg, "optim.min_lr")
    if _number(lr) and lr > 0 and _number(min_lr) and min_lr > lr:  # a bad lr is reported on its own
        out.append(f"optim.min_lr={min_lr} is not allowed: expected at most optim.lr={lr}")
    a, t = OmegaConf.select(cfg, "amsp.precision"), OmegaConf.select(cfg, "trainer.dtype")
    if a not in (None, "auto") and t not in (None, "auto") and a != t:  # each names the compute dtype
        out.append(f"amsp.precision={a} contradicts trainer.dtype={t}: set one of them")
    planner = OmegaConf.select(cfg, "amsp.planner")
    if planner is not None and planner.get("replan") is True and planner.get("recheck_steps") == 0:
        out.append("amsp.planner.replan=true needs a recheck to re-plan from: amsp.planner.recheck_steps is 0 "
                   "(set it to the step whose measurement decides)")
    if min_lr is None and OmegaConf.select(cfg, "optim.min_lr_ratio") is None:
        out.append("optim.min_lr and optim.min_lr_ratio are both null: set one (the cosine schedule's floor)")
    seq, longest = OmegaConf.select(cfg, "data.seq_len"), OmegaConf.select(cfg, "model.max_seq_len")
    if _number(seq) and _number(longest) and seq > longest:  # the RoPE tables stop at max_seq_len
        out.append(f"data.seq_len={seq} is not allowed: expected at most model.max_seq_len={longest} "
                   f"(raise model.max_seq_len or shorten data.seq_len)")
    tokens = OmegaConf.select(cfg, "trainer.global_batch_tokens")
    if _int(tokens) and tokens >= 1 and _int(seq) and seq >= 1 and tokens % seq:  # batch_geometry's rule, said
        # here so train.py refuses it before the process group, the run directory or the data exist
        out.append(f"trainer.global_batch_tokens={tokens} is not a multiple of data.seq_len={seq}")
    if OmegaConf.select(cfg, "amsp.fuse_wgrad") is True and OmegaConf.select(cfg, "model.compile") == "on":
        out.append("amsp.fuse_wgrad=true is not allowed with model.compile=on: the fused weight-gradient GEMM "
                   "calls the engine from the backward, which torch.compile cannot trace (model.compile=auto "
                   "keeps blocks eager with it)")
    out += _parallel_problems(cfg)
    out += _builtin_vocab_problems(cfg)
    out += _bandwidth_table_problems(cfg)
    init_from = OmegaConf.select(cfg, "trainer.init_from", default=None)
    if init_from is not None:  # a path that is neither an HF folder nor a checkpoint: named before any state
        from amsp.init_from import source_problem

        problem = source_problem(str(init_from))
        if problem:
            out.append(problem)
    return out


def _planner_degree_problems(cfg: DictConfig, what_if: bool) -> list[str]:
    """amsp.planner.tp / pp against parallel.tp / pp, by from_config.with_model_parallel's rule: 1 x 1 or equal
    to parallel's; the CLI's what-ifs (parallel at 1 x 1) may name others, and so may parallel.auto=true, where
    they fix the joint planner's tp x pp. A training run plans under parallel.* only."""
    degrees = [OmegaConf.select(cfg, k) for k in ("amsp.planner.tp", "amsp.planner.pp", "parallel.tp", "parallel.pp")]
    if not all(_int(v) and v >= 1 for v in degrees):
        return []  # missing, or reported by its rule
    planner, parallel = tuple(degrees[:2]), tuple(degrees[2:])
    if planner in ((1, 1), parallel) or OmegaConf.select(cfg, "parallel.auto") is True:
        return []
    if what_if and parallel == (1, 1):
        return []
    return [f"amsp.planner.tp={planner[0]}, amsp.planner.pp={planner[1]} contradict parallel.tp={parallel[0]}, "
            f"parallel.pp={parallel[1]}: a training run plans under parallel.tp / parallel.pp (amsp.planner.tp / pp "
            f"are the planner CLI's what-ifs and, with parallel.auto=true, the joint planner's tp x pp); name "
            f"parallel.tp / parallel.pp instead"]


def _builtin_vocab_problems(cfg: DictConfig) -> list[str]:
    """The built-in corpus's tokenizer, padded to data.pad_vocab_multiple, must fit model.vocab_size
    (data/tokenizer.py check_fits_model), which was found only after the tokenizer was trained and the corpus
    tokenized."""
    v, m = OmegaConf.select(cfg, "data.builtin.vocab_size"), OmegaConf.select(cfg, "data.pad_vocab_multiple")
    model = OmegaConf.select(cfg, "model.vocab_size")
    if OmegaConf.select(cfg, "data.prefix") or OmegaConf.select(cfg, "data.blend"):
        return []  # the built-in corpus is not used
    if not all(_int(x) and x >= 1 for x in (v, m, model)):
        return []  # unset (sized to fit), or reported by its rule
    padded = -(-v // m) * m
    if padded <= model:
        return []
    return [f"data.builtin.vocab_size={v} is not allowed: expected at most model.vocab_size={model} once padded to "
            f"a multiple of data.pad_vocab_multiple={m} (it pads to {padded}); lower it, or leave it unset to fit "
            f"the model"]


def model_shape_problems(cfg: DictConfig) -> list[str]:
    """The model's own shape rules (LlamaConfig.__post_init__: divisibility, even head_dim, the allowed
    backends), called rather than copied, so a shape that cannot build is one line here instead of a
    traceback from the build."""
    from configs.schema import to_llama_config

    if OmegaConf.select(cfg, "model") is None:
        return []
    try:
        to_llama_config(cfg.model)
    except (TypeError, ValueError) as e:
        return [" ".join(str(e).split())]
    return []


def _ffn_hidden_dim(cfg: DictConfig) -> int | None:
    """The MLP's hidden size by the model's own rule, or None where the model node does not make a
    valid config (its bad value is reported by the model build, which names it)."""
    from configs.schema import to_llama_config

    try:
        return to_llama_config(cfg.model).ffn_hidden_dim
    except (TypeError, ValueError, AttributeError):
        return None


def _bandwidth_table_problems(cfg: DictConfig) -> list[str]:
    """cluster.intra_node / inter_node read by the planner's own reader (cluster.curves_from_config: known
    collective kinds, readable sizes, positive bandwidths), so a bad table is one line before the run."""
    from amsp.planner.cluster import curves_from_config

    out = []
    for key, scope in (("intra_node", "intra"), ("inter_node", "inter")):
        table = _plain(OmegaConf.select(cfg, f"cluster.{key}"))
        if not table:
            continue
        try:
            curves_from_config(table, scope)
        except (TypeError, ValueError, AttributeError) as e:
            # the planner's reader names the entry (cluster.intra_node.all_gather: ...); the whole table is noise
            out.append(" ".join(str(e).split()))
    return out


def _cluster_file_problems(path: str) -> list[str]:
    """A mixed-cluster file that cannot be read, named before any process group exists (its fit to the
    launch is checked at startup, amsp/parallel/mixed_cluster.py)."""
    from amsp.errors import InputError
    from amsp.planner.device_preset import load_preset
    from amsp.planner.joint.hetero import read_cluster_file

    try:
        for _, preset, _ in read_cluster_file(path)[1]:
            load_preset(preset)  # exists; its figures resolve at startup (ValueError when it does not)
    except (InputError, ValueError) as e:
        return [f"parallel.cluster_file={path}: {e}"]
    return []


# parallel.* the joint planner sets at startup, with their defaults (configs/schema.py ParallelConfig)
JOINT_CHOOSES = {"tp": 1, "pp": 1, "schedule": "1f1b", "virtual_stages": 1, "layer_split": None,
                 "recompute_stages": None}
AMSP_DEGREES = ("p", "g", "os", "embed_head_p", "embed_head_g", "embed_head_os")


def _plain(v):
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def _given(p: DictConfig, keys) -> list[str]:
    """parallel.<key>=value for each of `keys` (of JOINT_CHOOSES) set to other than its default."""
    return [f"parallel.{k}={_describe(v)}" for k in keys if (v := _plain(OmegaConf.select(p, k))) != JOINT_CHOOSES[k]]


def _parallel_problems(cfg: DictConfig) -> list[str]:
    """parallel.* against the model and the batch: what can be known before any process group exists."""
    p = OmegaConf.select(cfg, "parallel")
    if p is None or not all(_int(OmegaConf.select(p, k)) and OmegaConf.select(p, k) >= 1
                            for k in ("tp", "pp", "virtual_stages")):
        return []  # missing, or already reported by its rule
    out = []
    n_layers = OmegaConf.select(cfg, "model.n_layers")
    stages = p.pp * p.virtual_stages
    split = OmegaConf.select(p, "layer_split")
    if split is not None and _int(n_layers):
        split = list(split)
        if len(split) != stages or sum(split) != n_layers:
            out.append(f"parallel.layer_split={split} is not allowed: expected {stages} stage sizes (pp x "
                       f"virtual_stages) summing to model.n_layers={n_layers}")
    elif _int(n_layers) and stages > n_layers:
        out.append(f"parallel.pp={p.pp} x parallel.virtual_stages={p.virtual_stages} is not allowed: more "
                   f"stages than model.n_layers={n_layers}")
    if p.pp > 1 and (problem := virtual_stages_problem(p.schedule, p.virtual_stages)) is not None:
        out.append(problem)
    if p.auto and OmegaConf.select(cfg, "amsp.plan") != "auto":
        out.append("parallel.auto=true is not allowed with a named amsp.plan: the joint planner chooses the AMSP "
                   "degrees too (set amsp.plan=auto)")
    if p.auto:  # what the joint planner chooses (amsp/parallel/joint_startup.py) is not also taken by hand
        given = _given(p, JOINT_CHOOSES)
        given += [f"amsp.{k}={OmegaConf.select(cfg, f'amsp.{k}')}" for k in AMSP_DEGREES
                  if OmegaConf.select(cfg, f"amsp.{k}") is not None]
        # its per-stage recomputation replaces this (joint_startup.with_joint_plan): a hand-given one never ran
        if (ac := OmegaConf.select(cfg, "model.activation_checkpointing")) not in (None, "none"):
            given.append(f"model.activation_checkpointing={ac}")
        if given:
            out.append(f"{', '.join(given)} not allowed with parallel.auto=true: the joint planner chooses "
                       f"them (it prices the 1F1B schedule); drop them, or set parallel.auto=false to run them as "
                       f"given")
    elif OmegaConf.select(cfg, "amsp.plan") == "auto" and OmegaConf.select(cfg, "amsp.p") is None:
        named = [f"amsp.{k}={OmegaConf.select(cfg, f'amsp.{k}')}" for k in AMSP_DEGREES[3:]
                 if OmegaConf.select(cfg, f"amsp.{k}") is not None]
        if named:  # the partitioner chooses the embedding+head degrees with the blocks'
            out.append(f"{', '.join(named)} not allowed with amsp.plan=auto alone: the partitioner chooses the "
                       f"embedding and head degrees too; name the blocks' amsp.p, amsp.g and amsp.os as well (an "
                       f"explicit plan), or drop them")
    cluster_file = OmegaConf.select(p, "cluster_file")
    if cluster_file and not p.auto:
        out.append(f"parallel.cluster_file={cluster_file} is not allowed without parallel.auto=true: the joint "
                   f"planner is what reads it (a hand-named tp/pp/layer_split runs as given on any cluster)")
    elif cluster_file:
        out += _cluster_file_problems(str(cluster_file))
    if p.tp > 1:
        for key in ("n_heads", "n_kv_heads", "vocab_size"):
            v = OmegaConf.select(cfg, f"model.{key}")
            if _int(v) and v % p.tp:
                out.append(f"parallel.tp={p.tp} is not allowed: model.{key}={v} is not divisible by it")
        ffn = _ffn_hidden_dim(cfg)  # the MLP's column/row split needs it too (tensor_parallel.check_divisible)
        if ffn is not None and ffn % p.tp:
            out.append(f"parallel.tp={p.tp} is not allowed: the MLP's hidden size {ffn} (from model.dim, "
                       f"model.multiple_of and model.ffn_dim_multiplier) is not divisible by it")
        seq = OmegaConf.select(cfg, "data.seq_len")
        if p.sequence_parallel and _int(seq) and seq % p.tp:
            out.append(f"parallel.sequence_parallel=true is not allowed with data.seq_len={seq}: not divisible "
                       f"by parallel.tp={p.tp} (set parallel.sequence_parallel=false)")
    if OmegaConf.select(cfg, "model.compile") == "on" and (p.tp > 1 or p.pp > 1):
        out.append(f"model.compile=on is not allowed with parallel.tp={p.tp}, parallel.pp={p.pp}: compiled blocks "
                   f"are not measured under model parallelism yet (model.compile=auto compiles only without it)")
    if OmegaConf.select(cfg, "amsp.fuse_wgrad") is True and p.tp > 1:
        out.append(f"amsp.fuse_wgrad=true is not allowed with parallel.tp={p.tp}: tensor-parallel weights keep "
                   f"autograd's gradients")
    if OmegaConf.select(cfg, "amsp.fuse_wgrad") is True and p.pp > 1 and p.schedule == "zero_bubble":
        out.append("amsp.fuse_wgrad=true is not allowed with parallel.schedule=zero_bubble: the fused GEMM runs in "
                   "the linear's backward, which the input-gradient pass and the weight pass both run")
    # Without a pipeline train.py never reads the schedule, its virtual stages or the per-stage recomputation:
    # refused rather than ignored (parallel.auto refuses them above; the planner CLI's what-if
    # amsp.planner.pp prices the named schedule)
    flags = OmegaConf.select(p, "recompute_stages")
    no_pipeline = p.pp == 1 and not p.auto
    what_if_pp = OmegaConf.select(cfg, "amsp.planner.pp", default=1)
    if no_pipeline and not (_int(what_if_pp) and what_if_pp > 1) and \
            (schedule := _given(p, ("schedule", "virtual_stages"))):
        out.append(f"{', '.join(schedule)} not allowed with parallel.pp=1: a pipeline schedule needs "
                   f"parallel.pp > 1 (drop them, or name parallel.pp)")
    if no_pipeline and flags is not None:
        out.append(f"parallel.recompute_stages={list(flags)} is not allowed with parallel.pp=1: it sets each "
                   f"pipeline stage's recomputation (parallel.pp > 1); without a pipeline set "
                   f"model.activation_checkpointing")
    elif flags is not None and len(flags) != stages:
        out.append(f"parallel.recompute_stages={list(flags)} is not allowed: expected {stages} flags (pp x "
                   f"virtual_stages)")
    if p.pp > 1 and OmegaConf.select(cfg, "model.tie_embeddings"):
        out.append("parallel.pp > 1 is not allowed with model.tie_embeddings=true: the embedding and the head "
                   "live on different stages")
    # parallelize_llama refuses it too, but only once the model is built on every rank
    if p.tp > 1 and OmegaConf.select(cfg, "model.tie_embeddings") and p.loss_parallel is False:
        out.append("parallel.loss_parallel=false is not allowed with parallel.tp > 1 and model.tie_embeddings="
                   "true: the tied head's logits stay vocabulary-sharded (set parallel.loss_parallel=true)")
    return out
