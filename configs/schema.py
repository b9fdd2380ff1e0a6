"""Typed schemas for the Hydra config tree, registered in Hydra's ConfigStore.

Because every group is a dataclass, an override with an unknown key or a value of the wrong type
is rejected by Hydra with the offending key named, before any model state exists.
Model presets are registered from models.llama.PRESETS, so the shapes have one source of truth.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from models.llama.config import PRESETS, LlamaConfig


@dataclass
class ModelConfig(LlamaConfig):
    name: str = "tiny"
    # torch.compile each transformer block's forward (amsp/compile.py): auto = off on CPU; on CUDA compiled only
    # where a timed block is at least 3% faster compiled (amsp/compile_choice.py).
    compile: str = "auto"  # auto | on | off


@dataclass
class BuiltinCorpusConfig:
    """The Python stdlib corpus used when neither data.prefix nor data.blend is set."""
    max_bytes: int = 12_000_000  # of stdlib sources, in path order
    # BPE pieces; None = the largest multiple of data.pad_vocab_multiple that fits model.vocab_size
    # (at most 32000): 8192 for tiny, 512 for debug.
    vocab_size: Optional[int] = None
    workers: int = 2  # tokenizer processes for the one-time preprocessing


@dataclass
class DataConfig:
    seq_len: int = 256
    # One preprocessed dataset (PREFIX.bin/.idx from python -m data.preprocess) ...
    prefix: Optional[str] = None
    # ... or several with weights: [[0.7, PREFIX1], [0.3, PREFIX2]], or Megatron's "0.7 PREFIX1 0.3 PREFIX2"
    # (a string or a flat list). Neither: the built-in corpus.
    blend: Optional[Any] = None
    tokenizer: Optional[str] = None  # what the datasets were made with: .model, tokenizer.json (or its folder), tiktoken file
    split: List[float] = field(default_factory=lambda: [98.0, 2.0])  # train/validation by documents
    # The validation documents are a random sample of each dataset drawn with this seed (independent of
    # trainer.seed, so seed sweeps validate on the same documents).
    split_seed: int = 1234
    valid_samples: int = 256  # size of the validation set (samples of seq_len + 1 tokens)
    seed: Optional[int] = None  # sample order seed; None = trainer.seed
    pad_vocab_multiple: int = 128  # tokenizer vocabulary padded to this multiple must fit model.vocab_size
    prefetch: int = 4  # micro-batches read ahead by the loader thread
    cache_dir: Optional[str] = None  # built-in corpus and sample indices; None = <repo>/.cache
    builtin: BuiltinCorpusConfig = field(default_factory=BuiltinCorpusConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    # The cosine's floor: min_lr if set, else lr x min_lr_ratio ("decay to 10% of the peak", which then
    # follows an optim.lr override; an absolute default would refuse a lower lr and ignore the ratio).
    min_lr: Optional[float] = None
    min_lr_ratio: Optional[float] = 0.1
    warmup_steps: int = 20
    decay_steps: Optional[int] = None  # None = trainer.max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class TrainerConfig:
    # 100 steps x 16 x 256 tokens of the tiny model is ~14 TFLOP: about 3 minutes on 2 CPU cores.
    max_steps: int = 100
    micro_batch_size: int = 8
    global_batch_size: int = 16  # samples per optimizer step, across all data-parallel ranks
    global_batch_tokens: Optional[int] = None  # if set, overrides global_batch_size via data.seq_len
    # A global batch that does not split into micro-batches on every rank is rounded to the nearest
    # whole number per rank (logged), so the defaults run on any world size; false = an error.
    round_global_batch: bool = True
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # compute dtype: auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16
    log_interval: int = 10
    output_dir: str = "runs"
    run_name: str = "${model.name}"
    threads: Optional[int] = None  # torch intra-op threads per rank; None = cores / local ranks
    # Checkpoints: RUN_DIR/checkpoints/step_N (+ `latest`); a run with `latest` resumes from it.
    checkpoint_interval: int = 50  # steps; 0 = only at the end and on SIGUSR1/SIGTERM
    keep_last_checkpoints: int = 3
    async_checkpoint: bool = False  # write in a background thread while training goes on
    resume: bool = True
    # Start a fresh run (step 0, fresh optimizer) from these weights: a Hugging Face model folder or a
    # checkpoint of this project (step_N or a run directory). Ignored when the run directory resumes.
    init_from: Optional[str] = None
    val_interval: int = 0  # steps between validation passes; 0 = only at the end
    val_samples: int = 64  # validation samples per pass (whole global rounds only)
    max_consecutive_skips: int = 5  # non-finite steps in a row before the run stops
    collective_timeout_s: float = 600.0  # a dead or hung rank makes the others exit after this
    # Resuming refuses a checkpoint written with another data.seq_len / tokenizer / data blend or sample
    # order seed, model.rope_theta / norm_eps / rope_scaling (model), or lr schedule (schedule) unless the
    # change is named here, e.g. [seq_len] (data/resume_check.py says how the data position moves).
    allow_resume_changes: List[str] = field(default_factory=list)


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline (written under RUN_DIR/wandb, `wandb sync` later) | disabled
    project: str = "amsp-llama"
    entity: Optional[str] = None
    name: Optional[str] = "${trainer.run_name}"
    tags: List[str] = field(default_factory=list)
    group: Optional[str] = None


@dataclass
class LoggingConfig:
    level: str = "INFO"
    # Per-device dense peak for MFU in TFLOP/s. None = auto: the GPU's datasheet peak, or on CPU a
    # measured matmul peak cached under $AMSP_CACHE_DIR (default ~/.cache/amsp).
    peak_tflops: Optional[float] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    plot: bool = True  # write RUN_DIR/metrics.png at the end of a run (python -m amsp.metrics.plot RUN_DIR)


@dataclass
class PlannerConfig:
    """The partitioner's knobs (amsp/planner): used when amsp.plan=auto and by python -m amsp.planner.
    Whether the parameter spread overlaps the next forward is amsp.overlap_spread, and how many units'
    spreads may be in flight amsp.spread_window (the engine's)."""
    probe: bool = True  # measure collective bandwidths on the real ranks at startup (else the preset)
    probe_cache: bool = True  # reuse a probe cached for the same cluster shape
    probe_budget_s: float = 4.0  # seconds of collectives the probe may spend; sizes stop growing there
    probe_max_mib: int = 256  # largest message the probe tries (64 KiB x 4^k up to this)
    # time one block's forward/backward, the head and the overlap slowdown on the real device at
    # startup (compute_profile.py) instead of FLOPs at `mfu`; cached like the probe
    measure_compute: bool = True
    cache_dir: Optional[str] = None  # None: $AMSP_CACHE_DIR/probe (default ~/.cache/amsp/probe)
    mfu: float = 0.45  # assumed hardware FLOP utilisation of the compute (recomputation counted)
    # what the allocator holds beyond the live tensors, as a fraction of the peak tensor bytes; None: the
    # run's allocator's (amsp/planner/allocator.py: 8% for CUDA's caching allocator, 0 for glibc set to
    # return freed blocks, 8% for glibc's defaults), logged at startup
    memory_margin: Optional[float] = None
    reserved_gib: float = 1.0  # runtime outside the allocator: CUDA context, workspaces, kernels
    # cap on model states (params + grads + optimizer states) per rank besides the device fit; None: none
    state_budget_gib: Optional[float] = None
    # Model-parallel degrees the planner prices the DP group under: a training run takes them from
    # parallel.tp / parallel.pp; set here for `python -m amsp.planner` what-ifs.
    tp: int = 1
    pp: int = 1
    # compute seconds lost per second of communication hidden behind it; None: measured at startup,
    # else the cluster preset's cluster.overlap_slowdown
    overlap_slowdown: Optional[float] = None
    top_k: int = 10  # alternatives shown in the table
    time_limit_s: float = 20.0  # CBC wall-clock limit
    # After this many steps the run compares measured step time and memory with the prediction, logs
    # the error, refits the model's constants and re-solves (amsp/replan_switch.py); 0 = never.
    recheck_steps: int = 20
    # Switch to a plan predicted >= replan_min_gain faster at the next checkpoint (only a plan the planner
    # chose).
    replan: bool = False
    # The least predicted gain worth a switch, which costs a checkpoint and a reload (0.05: 5% faster).
    replan_min_gain: float = 0.05
    # When the startup did not probe the links (probe=false), the recheck does (probe_budget_s) before it
    # refits: a step time alone cannot tell a wrong intra-node figure from a wrong inter-node one.
    recheck_probe: bool = True


@dataclass
class AMSPConfig:
    """The data-parallel layer (amsp/). `plan` is a preset name (ddp, zero1, zero2, zero3, hsdp) or
    "custom" with explicit degrees; giving p/g/os with a preset name is an error (ambiguous).
    The default, "auto", lets the partitioner (amsp/planner, knobs in `planner`) choose at startup."""
    plan: str = "auto"
    p: Optional[int] = None  # explicit shard degrees for the transformer blocks (all three together)
    g: Optional[int] = None
    os: Optional[int] = None
    embed_head_p: Optional[int] = None  # embedding + output head; default: the blocks' degrees
    embed_head_g: Optional[int] = None
    embed_head_os: Optional[int] = None
    ranks_per_node: Optional[int] = None  # default: the launcher's LOCAL_WORLD_SIZE; set to pose as nodes
    precision: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16: compute weights + communication
    grad_comm: str = "auto"  # gradient collectives' dtype: auto (= fp32: reduction accumulates in fp32) | fp32 | bf16
    overlap_spread: bool = False  # overlap the parameter spread with the next step's forward
    # Units whose parameter spread may be in flight at once (>= 1); each holds a received S/p buffer in
    # the compute dtype, which the planner's memory model counts.
    spread_window: int = 2
    # Each unit's AdamW update waits for the unit's next forward; on CUDA it runs on a side stream beside
    # that forward (amsp/overlapped_update.py). Off by default: it won 0.3% on an H200 (BENCHMARKS.md).
    overlap_update: bool = False
    # Linear layers' weight gradients accumulated by their own GEMM into the fp32 gradient buffers
    # (amsp/wgrad_fusion.py, as Megatron-LM's gradient_accumulation_fusion). Not with compiled blocks
    # (model.compile=auto then keeps them eager) or tensor parallelism.
    fuse_wgrad: bool = False
    # The sharded AdamW's kernel: auto (torch's fused AdamW where the device has it, else foreach ops) |
    # fused | foreach | csrc (amsp_fused::adamw_update: one pass that also writes the bf16 weights of units
    # with os = p and leaves the gradient unwritten; not yet timed on a GPU)
    optimizer_kernel: str = "auto"
    prefetch: bool = True  # prefetch the next unit's parameter all-gather
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # used when plan=auto


@dataclass
class ClusterConfig:
    """The machines, for the partitioner (amsp/planner/cluster.py): presets in configs/cluster/.

    Bandwidth tables map a message size ("1MiB") to the NCCL-tests bus bandwidth in GB/s per
    collective kind; intra_node is per rank, inter_node per node (all its NICs). Missing tables use
    the alpha-beta figures. nodes / ranks_per_node are overridden by the launcher at run time."""
    name: str = "cpu"
    nodes: int = 1
    ranks_per_node: int = 1
    device_memory_gib: Optional[float] = None  # None: measured at run time (cpu)
    peak_tflops: Optional[float] = None  # dense, training dtype; None: measured at run time (cpu)
    memory_bandwidth_gbs: float = 10.0
    dtype: str = "fp32"  # what trainer.dtype=auto means on this cluster
    # cpu | cuda: what the devices can run beside each other (CUDA streams: the overlapped optimizer
    # update, amsp.overlap_update, hides there; on CPU it runs inline). A run's own device overrides it.
    device: str = "cpu"
    intra_node: Dict[str, Any] = field(default_factory=dict)  # kind -> {size: GB/s}; checked on load
    inter_node: Dict[str, Any] = field(default_factory=dict)
    intra_latency_us: float = 50.0
    intra_bandwidth_gbs: float = 2.0
    inter_latency_us: float = 50.0
    inter_bandwidth_gbs: float = 2.0
    overlap_slowdown: float = 0.1  # compute seconds lost per second of hidden communication


@dataclass
class ParallelConfig:
    """Model parallelism beside AMSP (amsp/parallel/): the AMSP plan (amsp.*) then shards each rank's
    TP-local, stage-local parameters over its data-parallel group of world / (tp * pp) ranks."""
    tp: int = 1  # tensor-parallel degree; divides the ranks per node (TP groups stay inside a node)
    pp: int = 1  # pipeline stages
    sequence_parallel: bool = True  # TP: norms and residual stream split over the sequence (needs seq_len % tp == 0)
    loss_parallel: bool = True  # TP: cross-entropy on vocabulary-sharded logits (full logits never built)
    # pipeline schedule: 1f1b | interleaved | gpipe | zero_bubble (torch's interleaved zero-bubble, ZB1P: each
    # backward split into an input-gradient pass and a weight pass that fills the bubbles; any virtual_stages)
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per rank for interleaved schedules (interleaved: >= 2; zero_bubble: any)
    layer_split: Optional[List[int]] = None  # layers per (virtual) stage; None: balanced, embedding and head weighted
    # full activation recomputation per pipeline stage (the joint planner sets it); None: model.activation_checkpointing
    recompute_stages: Optional[List[bool]] = None
    # The joint planner (amsp/planner/joint) chooses tp, pp, the layer split, the micro-batch size and the
    # AMSP degrees at startup; needs amsp.plan=auto.
    auto: bool = False
    # parallel.auto on a mixed cluster: a file of node groups (configs/clusters_mixed/), the hosts launched in
    # its order; each group's compute is measured on its own ranks (amsp/parallel/mixed_cluster.py)
    cluster_file: Optional[str] = None


@dataclass
class DebugConfig:
    # Fault injection, to exercise the recovery paths end to end (tests, cluster drills).
    nan_loss_at_steps: List[int] = field(default_factory=list)  # 1-based steps whose loss is NaN
    die_at_step: Optional[int] = None  # 1-based step in which debug.die_rank exits abruptly
    die_rank: int = 0
    stop_at_step: Optional[int] = None  # 1-based step in which debug.stop_rank sends itself SIGSTOP (a hung rank)
    stop_rank: int = 0
    clock_skew_s: float = 0.0  # debug.clock_skew_rank publishes a heartbeat wall clock this far off (never compared)
    clock_skew_rank: Optional[int] = None


@dataclass
class TrainConfig:
    defaults: List[Any] = field(default_factory=list)
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    amsp: AMSPConfig = field(default_factory=AMSPConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, preset in PRESETS.items():
        cs.store(group="model", name=name, node=ModelConfig(name=name, **{f.name: getattr(preset, f.name) for f in fields(preset)}))
    # Each group's schema sits at the store's root, not in its group: a group's files extend it through
    # `/<name>_schema@_here_` in their defaults list. Stored in the group, Hydra offered it as a preset
    # (train.py --help listed `cluster: ..., cluster_schema, ...`, and `cluster=cluster_schema` composed it).
    cs.store(name="adamw_schema", node=OptimConfig)
    cs.store(name="trainer_schema", node=TrainerConfig)
    cs.store(name="data_schema", node=DataConfig)
    cs.store(name="logging_schema", node=LoggingConfig)
    cs.store(name="amsp_schema", node=AMSPConfig)
    cs.store(name="cluster_schema", node=ClusterConfig)


def to_llama_config(model_cfg: Any) -> LlamaConfig:
    """Resolved model node (DictConfig or ModelConfig) -> the model's own LlamaConfig."""
    from omegaconf import OmegaConf

    from models.llama.config import RopeScaling

    d = OmegaConf.to_container(model_cfg, resolve=True) if not isinstance(model_cfg, dict) else dict(model_cfg)
    d.pop("name", None)
    d["rope_scaling"] = RopeScaling(**d.get("rope_scaling") or {})
    return LlamaConfig(**{k: v for k, v in d.items() if k in LlamaConfig.field_names()})
