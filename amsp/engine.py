"""The AMSP engine: runs a plan on the pure LLaMA model through module hooks.

The model is built on the meta device; each unit (the embedding, every transformer block, the
final norm + head; with tied embeddings the embedding and head form one unit) gets a FlatUnit
holding its shards, and its parameters become views of the unit's gathered buffer. Hooks:
  * forward pre-hook: wait for / run the unit's P all-gather, prefetch the next unit's;
    forward hook on the unit's last module: free the gathered buffer;
  * backward pre-hook (a hook on the output's gradient): gather again (prefetched one unit
    ahead in backward order); the
    buffer stays until the unit's gradients are complete, so a checkpoint recompute reuses it;
  * post-accumulate-grad hooks: when all of a unit's parameters have their gradient, flatten,
    free, and launch the G reduce-scatter; one unit later (double buffering) the result is added
    to the fp32 G shard and, on the last micro-batch, the G->OS reduce-scatter is launched, and one
    unit after that the OS-replica all-reduce: the hierarchical sync overlaps the rest of backward.
After backward the pipeline is drained; step() waits for the sync, runs the sharded AdamW and the
parameter spread, at most `spread_window` units in flight in forward order (synchronously, or
overlapped with the next forward unit by unit, guarded by a per-unit version that must equal the
optimizer's step count before the unit may run). With overlap_update the AdamW update itself moves
into the next forward too, unit by unit (amsp/overlapped_update.py); step() then computes only the
global norm.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager

import torch
import torch.nn as nn

from models.llama.config import LlamaConfig
from models.llama.init import init_slice_into
from models.llama.model import Llama

from .collectives import Comm, CommStats
from .engine_hooks import EngineHook
from .engine_pipeline import PipelineMicroBatches
from .flat_unit import FlatUnit, ParamSlot
from .fragments import Fragment, load_fragment, unit_fragments
from .grad_accumulate import describe as describe_accumulation
from .groups import ensure_groups, unit_groups
from .optim import decays
from .overlapped_update import OverlappedUpdates
from .parallel.tp_slices import TPSlot, tp_slot_of
from .plan import Plan, validate_degrees
from .schedule import Precision, Unit
from .sharded_optim import AdamWSettings, ShardedAdamW, StepResult
from .spread_window import SpreadWindow
from .topology import Topology
from . import wgrad_fusion

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(name: str, device: torch.device) -> str:
    """auto: fp32 on CPU (bf16 matmuls run at under half the fp32 rate there), bf16 on CUDA."""
    if name not in PRECISIONS:
        raise ValueError(f"amsp.precision={name!r} is not one of {'|'.join(PRECISIONS)}")
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return name


def resolve_grad_comm(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """auto: fp32 whatever the compute dtype. A reduce-scatter sums in its wire dtype, so bf16 traffic
    also means bf16 accumulation across ranks (8 bits of mantissa for a sum over the whole group);
    Megatron and torchtitan reduce in fp32 by default for that reason. bf16 halves the gradient bytes
    and stays available for links that are the bottleneck."""
    table = {"auto": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"amsp.grad_comm={name!r} is not one of {'|'.join(table)}")
    return table[name]


@dataclass
class ModelParts:
    """What of the model this rank's engine holds: a pipeline stage (or several virtual stages, each a
    `chunk`), on a model built on the meta device that may already be tensor-parallel (DTensor
    parameters). Default: the whole model, built by the engine."""

    model: Llama
    embed: bool = True
    layers: list[int] | None = None  # None: every layer
    head: bool = True
    # Virtual pipeline stages on this rank: chunk index per layer (and for the embedding / head). A
    # backward of one chunk is one micro-batch for that chunk's units. None: one chunk.
    chunk_of_layer: dict[int, int] | None = None
    embed_chunk: int = 0
    head_chunk: int = 0
    # Entered around every forward and backward the engine runs: tensor parallelism's loss_parallel()
    # (a cross-entropy over vocabulary-sharded logits needs it in both passes).
    loss_context: Callable[[], ContextManager] = nullcontext


@dataclass(frozen=True)
class EngineOptions:
    precision: str = "auto"  # auto | fp32 | bf16 (compute weights and communication)
    # Gradient collectives' dtype: auto = fp32 (reduction accumulates in fp32, as Megatron and torchtitan
    # do); bf16 halves the traffic where links are the bottleneck, with bf16 accumulation across ranks.
    grad_comm: str = "auto"
    overlap_spread: bool = False  # spread overlaps the next step's forward, unit by unit
    # Units whose spread may be in flight at once (each holds a received S/p buffer, plus the master's
    # cast in bf16): launched in forward order, each completion launches the next.
    spread_window: int = 2
    # Each unit's AdamW update (and its spread) runs at the unit's next forward instead of in step():
    # on CUDA on a side stream beside the forward (amsp/overlapped_update.py). Implies a lazy spread.
    overlap_update: bool = False
    prefetch: bool = True  # prefetch the next unit's P all-gather in forward and backward
    # Gradient reduce-scatters (and the last micro-batch's hierarchical sync) run in the background
    # of the remaining backward; False waits for each as soon as it is launched (for benchmarks).
    async_grad_reduce: bool = True
    # Linear layers' weight gradients accumulated by their own GEMM into the G shard / reduce-scatter buffer
    # (amsp/wgrad_fusion.py) instead of leaving autograd as tensors the hooks add in. Not with TP-sharded
    # weights or compiled blocks.
    fuse_wgrad: bool = False
    optimizer_kernel: str = "auto"  # amsp/sharded_optim.py KERNELS
    optim: AdamWSettings = AdamWSettings()

    def __post_init__(self) -> None:
        if not isinstance(self.spread_window, int) or self.spread_window < 1:
            raise ValueError(f"amsp.spread_window={self.spread_window!r} must be an integer >= 1 (units whose "
                             f"parameter spread may be in flight at once)")


class AMSPEngine(PipelineMicroBatches):
    def __init__(self, model_cfg: LlamaConfig, plan: Plan, topo: Topology, rank: int, *, seed: int = 0,
                 device: torch.device | str = "cpu", options: EngineOptions = EngineOptions(),
                 parts: ModelParts | None = None, mesh=None):
        """`topo` is the data-parallel group the plan shards over; with model parallelism pass the
        ParallelMesh (amsp/parallel/mesh.py) too: then topo must be mesh.dp_topology(rank), the plan's
        degrees refer to that group, and `parts` says which (TP-local) parameters this rank holds."""
        if mesh is not None and topo != mesh.dp_topology(rank):
            raise ValueError(f"with a mesh the engine's topology must be the rank's DP group "
                             f"{mesh.dp_topology(rank)}, got {topo}")
        self.cfg, self.plan, self.topo, self.rank, self.mesh = model_cfg, plan, topo, rank, mesh
        self.position = topo.position(rank)  # rank inside the data-parallel group
        self.device = torch.device(device)
        self.options = options
        # Rules first: nothing is allocated for an invalid plan.
        for grp in ("blocks", "embed_head"):
            validate_degrees(plan.for_group(grp), topo.world, topo.ranks_per_node, what=f"plan {grp}")
        self.precision_name = resolve_precision(options.precision, self.device)
        dtype = torch.float32 if self.precision_name == "fp32" else torch.bfloat16
        self.compute_dtype = dtype
        self.grad_dtype = resolve_grad_comm(options.grad_comm, dtype)
        self.precision = Precision(param_bytes=dtype.itemsize, grad_bytes=self.grad_dtype.itemsize)
        ensure_groups([plan.blocks, plan.embed_head], mesh.dp_topologies() if mesh is not None else topo)
        self.comm = Comm(topo, rank)
        if parts is None:
            with torch.device("meta"):
                parts = ModelParts(Llama(model_cfg))
        self.parts = parts
        self.model = parts.model
        self.units = self._build_units(dtype)
        self._materialise(seed)
        world = tuple(range(mesh.world)) if mesh is not None else None
        self.optim = ShardedAdamW(self.units, options.optim, self.comm, kernel=options.optimizer_kernel,
                                  norm_ranks=world)
        self._updates = OverlappedUpdates(self.optim, self.units, self.device)
        self._fwd_order = self.units
        self._bwd_order = sorted(self.units, key=lambda u: self._module_pos[id(u.modules[-1])], reverse=True)
        self._chunk = {id(u): c for u, c in zip(self.units, self._unit_chunks)}
        self._pipeline: dict | None = None  # begin_microbatches(): {"expected": n, "seen": {chunk: k}}
        self._install_hooks()
        self._last_stats = CommStats()
        self._micro_state: dict | None = None  # per backward: last flag, unit pipeline
        self._accumulating = False  # a micro-batch has run since the last step()
        self._synced_last = False
        self._released = False  # release() gave the memory back: a plan switch replaced this engine
        self._spreads = SpreadWindow(self._fwd_order, options.spread_window, self._updates)
        self._log_choices()

    # ---- construction ----
    def _unit_specs(self) -> list[tuple[str, str, list[nn.Module], int]]:
        """(unit name, plan group, modules, chunk) in forward order, for the parts this rank holds."""
        m, parts = self.model, self.parts
        layers = range(len(m.layers)) if parts.layers is None else parts.layers
        chunk_of = parts.chunk_of_layer or {}
        specs = [(f"layers.{i}", "blocks", [m.layers[i]], chunk_of.get(i, 0)) for i in layers]
        if self.cfg.tie_embeddings and (parts.embed or parts.head):
            if not (parts.embed and parts.head and parts.embed_chunk == parts.head_chunk):
                raise ValueError("tied embeddings need the embedding and the head in the same pipeline stage; "
                                 "set model.tie_embeddings=false for pipeline parallelism")
            # The head projects with tok_embeddings.weight: one unit, gathered from the embedding's
            # forward to the head's, so both uses see the same buffer and one gradient.
            return [("embed_head", "embed_head", [m.tok_embeddings, m.head], parts.embed_chunk)] + specs
        head = [("head", "embed_head", [m.head], parts.head_chunk)] if parts.head else []
        embed = [("tok_embeddings", "embed_head", [m.tok_embeddings], parts.embed_chunk)] if parts.embed else []
        return embed + specs + head

    def _build_units(self, dtype: torch.dtype) -> list[FlatUnit]:
        names = {id(mod): n for n, mod in self.model.named_modules()}
        order = [self.model.tok_embeddings, *self.model.layers, self.model.head]
        self._module_pos = {id(mod): i for i, mod in enumerate(order)}
        units, seen, self._unit_chunks = [], set(), []
        for uname, grp, modules, chunk in self._unit_specs():
            self._unit_chunks.append(chunk)
            slots, offset = [], 0
            for mod in modules:
                for full_name, p in mod.named_parameters(prefix=names[id(mod)]):
                    if full_name in seen:
                        continue
                    owner_name, _, attr = full_name.rpartition(".")
                    owner = self.model.get_submodule(owner_name)
                    tp = tp_slot_of(p)
                    shape = p.shape if tp is None else tp.local_shape
                    tp_copy = (tp.replicated if tp is not None else self.mesh is not None and self.mesh.tp > 1)
                    counted = not tp_copy or self.mesh.coords(self.rank).tp == 0
                    slots.append(ParamSlot(full_name, owner, attr, shape, offset, decays(full_name, p), tp, counted))
                    seen.add(full_name)
                    offset += shape.numel()
            deg = self.plan.for_group(grp)
            groups = unit_groups(deg, self.topo, self.rank)
            units.append(FlatUnit(uname, grp, modules, slots, deg, groups, self.position, self.topo.world, dtype,
                                  self.grad_dtype, self.device, self.comm))
        held = {n for mod in (mod for *_, mods, _c in self._unit_specs() for mod in mods)
                for n, _ in mod.named_parameters(prefix=names[id(mod)])}
        if held - seen:
            raise RuntimeError(f"parameters in no unit: {sorted(held - seen)}")
        return units

    def _materialise(self, seed: int) -> None:
        """Initialise only the slices this rank holds, on its device, with the model's own
        element-wise init (models/llama/init.py): the values do not depend on the plan or the rank,
        and no rank builds more than one init chunk of fp32 beyond its own shards."""
        start = time.perf_counter()

        def fill(slot: ParamSlot, lo: int, hi: int, out: torch.Tensor) -> None:
            if slot.tp is None:
                init_slice_into(self.cfg, slot.name, slot.shape, lo, hi, seed, out)
                return
            # A TP shard: the full parameter's values at the global positions of the local elements.
            for local, glob, n in slot.tp.global_runs(lo, hi):
                init_slice_into(self.cfg, slot.name, slot.tp.global_shape, glob, glob + n, seed,
                                out[local - lo:local - lo + n])

        for u in self.units:
            u.fill_shards(fill)
            u.install_params()
        for mod in self.model.modules():
            for bname, buf in list(mod._buffers.items()):
                if buf is not None and buf.is_meta:
                    mod._buffers[bname] = torch.empty(buf.shape, dtype=torch.float32, device=self.device)
        self.model.init_rope()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the draws run asynchronously: time them, not their launch
        if self.rank == 0:
            held = sum(u.p_shard.numel() + (0 if u.master_is_weights else u.master.numel()) for u in self.units)
            log.info("initialised rank 0's shards (%d elements, P shards + separate fp32 masters) on %s in %.2fs",
                     held, self.device, time.perf_counter() - start)

    def _next_in_chunk(self, order: list[FlatUnit], i: int) -> FlatUnit | None:
        """The unit after order[i] in the same chunk (virtual stage): prefetching across chunks would
        gather a unit that the schedule may run many micro-batches later."""
        if i + 1 < len(order) and self._chunk[id(order[i + 1])] == self._chunk[id(order[i])]:
            return order[i + 1]
        return None

    def _install_hooks(self) -> None:
        hook = EngineHook.factory(self)  # holds the engine weakly: amsp/engine_hooks.py says why
        self.fused_linears = 0
        fuse = wgrad_fusion.fusing(self.options.fuse_wgrad, self.compute_dtype, self.device)
        for i, u in enumerate(self._fwd_order):
            nxt = self._next_in_chunk(self._fwd_order, i)
            for j, mod in enumerate(u.modules):
                mod.register_forward_pre_hook(hook("_pre_forward", u, nxt if j == 0 else None))
                mod.register_forward_hook(hook("_post_forward", u, j == len(u.modules) - 1))
            for s in u.slots:
                u.param(s).register_post_accumulate_grad_hook(hook("_grad_ready", u, s))
                if fuse and s.tp is None and wgrad_fusion.fusable(s.module, s.attr):
                    wgrad_fusion.install(s.module, hook("_fused_wgrad", u, s))
                    self.fused_linears += 1
        self._bwd_next = {id(u): self._next_in_chunk(self._bwd_order, i) for i, u in enumerate(self._bwd_order)}

    def _log_choices(self) -> None:
        if self.rank != 0:
            return
        on = {True: "on", False: "off"}
        spreading = sum(u.deg.p != u.deg.os for u in self.units)  # units whose step ends in a spread
        spread = (f"{on[self.options.overlap_spread]} (window {self.options.spread_window} units)" if spreading
                  else f"{on[self.options.overlap_spread]}, no effect (p = os for every unit: nothing to spread)")
        log.info("AMSP plan %s on %d ranks (%d per node); precision %s; prefetch %s; async grad reduce %s; "
                 "spread overlap %s", self.plan, self.topo.world, self.topo.ranks_per_node,
                 f"{self.precision_name} (gradient communication {str(self.grad_dtype).removeprefix('torch.')})",
                 on[self.options.prefetch], on[self.options.async_grad_reduce], spread)
        log.info("gradient accumulation into the fp32 G shards: %s", describe_accumulation(self.device))
        if self.fused_linears:
            log.info("linear weight gradients: accumulated by their own GEMM into the gradient buffers "
                     "(amsp.fuse_wgrad): %d linear layers routed (the head's serves only an unfused loss)%s",
                     self.fused_linears,
                     "" if self.mesh is None or self.mesh.tp == 1 else "; tensor-parallel ones keep their hooks")
        log.info("optimizer update: %s", self._updates.describe() if self.options.overlap_update
                 else "in step(), every unit at once")
        for grp in ("blocks", "embed_head"):
            us = [u for u in self.units if u.group == grp]
            if us:
                log.info("  %s: %d units, p/g/os = %s, %d parameters (padded %d)", grp, len(us), us[0].deg,
                         sum(u.layout.numel for u in us), sum(u.layout.padded for u in us))

    def _ensure_fresh(self, u: FlatUnit) -> None:
        self._spreads.ensure_fresh(u, self.optim.steps)

    # ---- hooks ----
    def _pre_forward(self, u: FlatUnit, nxt: FlatUnit | None, module, args) -> None:
        self._ensure_fresh(u)
        u.wait_gather("forward")
        if nxt is not None and self.options.prefetch:
            self._ensure_fresh(nxt)
            nxt.start_gather("forward")

    def _post_forward(self, u: FlatUnit, last: bool, module, args, output) -> None:
        # The backward pre-hook is a hook on the module's output gradient: it runs before any of
        # the module's backward nodes, hence before a checkpoint recompute. (A full backward
        # pre-hook does the same through a wrapper, but warns for the embedding, whose input is
        # integer tokens.)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._pre_backward, u))
        if last:
            u.free()

    def _state_of(self, u: FlatUnit, starting: bool = False) -> dict:
        """The micro-batch state a unit's backward belongs to. forward_backward() makes one for the whole
        model; under a pipeline schedule (begin_microbatches) each chunk's backward is one micro-batch of
        that chunk, its state made when the chunk's first unit starts its backward."""
        if self._pipeline is None:
            if self._micro_state is None:
                raise RuntimeError("AMSP: backward outside engine.forward_backward() or begin_microbatches() "
                                   "is not supported")
            return self._micro_state
        c = self._chunk[id(u)]
        states = self._pipeline["states"]
        if c not in states:
            # With the weight gradients deferred (zero-bubble schedules) a chunk's backward is its weight
            # pass, which delivers all of its gradients at once: the state starts with the first of them.
            if not starting and not self._pipeline["deferred"]:
                raise RuntimeError(f"AMSP: unit {u.name} got a gradient before its backward started")
            seen = self._pipeline["seen"].get(c, 0)
            if seen >= self._pipeline["expected"]:
                raise RuntimeError(f"AMSP: more than {self._pipeline['expected']} backward passes through "
                                   f"pipeline chunk {c} in one step")
            units = [x for x in self.units if self._chunk[id(x)] == c]
            states[c] = self._new_micro_state(seen == self._pipeline["expected"] - 1, units)
        return states[c]

    @staticmethod
    def _new_micro_state(last: bool, units: list[FlatUnit]) -> dict:
        return {"last": last, "bwd_started": set(), "done": set(), "pipeline": [], "units": units,
                "waiting": {id(u): len(u.slots) for u in units}, "stage": {id(u): 0 for u in units},
                "wgrad_started": set()}

    @staticmethod
    def _first_grad(st: dict, u: FlatUnit) -> bool:
        """Whether no gradient of `u` has reached it yet in this micro-batch, through its parameter hooks or
        a fused weight-gradient GEMM (which runs before its parameter's hook)."""
        return st["waiting"][id(u)] == len(u.slots) and id(u) not in st["wgrad_started"]

    def _pre_backward(self, u: FlatUnit, grad_output) -> None:
        if self._pipeline is not None and self._pipeline["deferred"]:
            # An input-gradient pass (zero-bubble): it needs the weights, and the micro-batch's gradients
            # come later, in its weight pass (weight_grads_ready), which starts the chunk's state.
            u.wait_gather("backward")
            nxt = self._bwd_next[id(u)]
            if nxt is not None and self.options.prefetch:
                nxt.start_gather("backward")
            return
        st = self._state_of(u, starting=True)
        first = id(u) not in st["bwd_started"]
        st["bwd_started"].add(id(u))
        u.wait_gather("backward")
        nxt = self._bwd_next[id(u)]
        if first and nxt is not None and self.options.prefetch and id(nxt) not in st["done"]:
            nxt.start_gather("backward")

    def _fused_wgrad(self, u: FlatUnit, slot, gy: torch.Tensor, x: torch.Tensor) -> None:
        """A linear layer's weight gradient from its own backward (amsp/wgrad_fusion.py), before its hook."""
        st = self._state_of(u)
        first = self._first_grad(st, u)
        st["wgrad_started"].add(id(u))
        u.fused_wgrad(slot, gy, x, first)

    def _grad_ready(self, u: FlatUnit, slot, param) -> None:
        st = self._state_of(u)
        u.take_grad(slot, param, first=self._first_grad(st, u))
        left = st["waiting"][id(u)] - 1
        st["waiting"][id(u)] = left
        if left:
            return
        st["done"].add(id(u))
        flat = u.take_flat_grads()
        u.free()  # gradients are complete: the recompute (if any) is over, the buffer can go
        if flat is not None:
            u.launch_grad_reduce(flat)
        if not self.options.async_grad_reduce:
            st["pipeline"].append(u)
            self._advance(st, u, 2 if st["last"] else 1)
            if st["last"]:
                u.finish_sync()
        else:
            # Double buffering: complete the previous unit's reduce-scatter (launched one unit ago,
            # normally finished by now) and move the last micro-batch's sync one stage on.
            pipe = st["pipeline"]
            if pipe:
                self._advance(st, pipe[-1], 1)
            if st["last"] and len(pipe) >= 2:
                self._advance(st, pipe[-2], 2)
            pipe.append(u)
        if self._pipeline is not None and len(st["done"]) == len(st["units"]):
            self._end_chunk_backward(self._chunk[id(u)], st)

    def _drain(self, st: dict) -> None:
        """After a micro-batch's backward: every reduce-scatter into the G shards done, and on the last
        micro-batch every unit's sync launched."""
        not_done = [u.name for u in st["units"] if id(u) not in st["done"]]
        if not_done:
            raise RuntimeError(f"AMSP: units {not_done} got no complete gradient in this backward")
        for u in st["pipeline"]:
            self._advance(st, u, 1)
        if st["last"]:
            for u in st["pipeline"]:
                self._advance(st, u, 2)

    def _advance(self, st: dict, u: FlatUnit, stage: int) -> None:
        """Stages: 0 G reduce-scatter launched; 1 added to the G shard (+ G->OS launched on the last
        micro-batch); 2 OS-replica all-reduce launched (last micro-batch only)."""
        stages = st["stage"]
        while stages[id(u)] < stage:
            s = stages[id(u)]
            if s == 0:
                u.finish_grad_reduce()
                if st["last"]:
                    u.launch_os_reduce()
            elif s == 1:
                u.launch_replica_reduce()
            stages[id(u)] = s + 1

    # ---- training API ----
    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, micro_index: int,
                         num_micro: int) -> torch.Tensor:
        """One micro-batch: forward, backward, gradient reduce-scatter into the G shards; the last
        micro-batch (micro_index == num_micro - 1) also runs the hierarchical sync. Returns the
        (unscaled, detached) mean loss of this micro-batch on this rank."""
        if not 0 <= micro_index < num_micro:
            raise ValueError(f"micro_index {micro_index} outside [0, {num_micro})")
        self._check_live()
        if self._synced_last:
            raise RuntimeError("AMSP: the last micro-batch already ran; call step() before the next one")
        if self._pipeline is not None:
            raise RuntimeError("AMSP: forward_backward() inside begin_microbatches(); the pipeline schedule "
                               "runs the micro-batches")
        last = micro_index == num_micro - 1
        self._micro_state = self._new_micro_state(last, self.units)
        try:
            with self.parts.loss_context():
                loss = self.model(to_device(tokens, self.device), to_device(targets, self.device))
                # Each rank's micro-batch mean, scaled so the sum over ranks and micro-batches is the
                # mean over the global batch.
                (loss * (1.0 / (num_micro * self.topo.world))).backward()
            self._drain(self._micro_state)
        finally:
            self._micro_state = None
        self._accumulating = True
        self._synced_last = last
        return _plain(loss.detach())

    def step(self, lr: float) -> StepResult:
        """Wait for the gradient sync, AdamW on the OS shards, then spread the new weights (with
        overlap_update: the global norm only; each unit's update and spread wait for its next forward)."""
        if not self._synced_last:
            raise RuntimeError("AMSP: step() needs a completed last micro-batch (micro_index == num_micro - 1)")
        for u in self.units:
            u.finish_sync()
        self.finish_spread()  # a no-op after a forward; the optimizer must not write a master being sent
        if self.options.overlap_update:
            prepared = self.optim.prepare(lr)
            result = prepared.result
            if not result.skipped:  # each unit's OS gradient is dropped when its update is taken
                self._updates.defer(prepared, self._fwd_order, lambda u: u.deg.os == u.deg.p)
        else:
            result = self.optim.step(lr)
        if not self._updates.pending:
            for u in self.units:
                u.zero_grad_state()
        if not result.skipped:
            self._spreads.start()
            if not (self.options.overlap_spread or self.options.overlap_update):
                self.finish_spread()
        self._accumulating = self._synced_last = False
        self._last_stats = self.comm.close_step()
        return result

    def finish_spread(self) -> None:
        """Complete every pending update and spread in forward order, the window refilling as each lands
        (done lazily per unit by the forward pre-hook when they overlap the forward)."""
        for u in self.units:
            self._ensure_fresh(u)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward-only mean loss of one batch on this rank (validation). Between steps only; its
        gathers are not booked to any training step."""
        if self._accumulating:
            raise RuntimeError("AMSP: evaluate() in the middle of a step; call it after step()")
        with self.parts.loss_context():
            loss = self.model(to_device(tokens, self.device), to_device(targets, self.device))
        self.comm.close_step()  # validation traffic is not part of a training step
        return _plain(loss.detach())

    def release(self) -> None:
        """Give back this engine's device memory now, whoever still references it: every unit's shards,
        gathered weights, gradient buffers and optimizer states. A plan switch (amsp/replan_switch.py)
        calls it before building the next engine, which would otherwise be allocated beside this one
        (two sets of model states: a plan near the memory limit fails there). Completes the pending
        spreads first, so no collective writes into freed memory; the engine cannot be used after."""
        if self._accumulating:
            raise RuntimeError("AMSP: release() in the middle of a step; call it after step()")
        self.finish_spread()
        kept = sum(u.release() for u in self.units)
        if kept:
            log.warning("AMSP: %.1f MiB of the released engine's buffers cannot shrink (non-resizable storages: "
                        "something exposed them through Tensor.numpy()); they are freed with their last reference",
                        kept / 2**20)
        self._released = True

    def _check_live(self) -> None:
        if self._released:
            raise RuntimeError("AMSP: this engine was released (a plan switch replaced it); use the new engine")

    def comm_stats(self) -> CommStats:
        """Communication of the last completed step (bytes booked at launch, blocked wait time)."""
        return self._last_stats

    # ---- introspection for the planner contract, tests and the checkpoint writer ----
    @property
    def optimizer_steps(self) -> int:
        return self.optim.steps

    def schedule_units(self) -> list[Unit]:
        return [Unit(u.name, u.group, u.layout.numel) for u in self.units]

    def degrees_of(self) -> dict:
        return {"blocks": self.plan.blocks, "embed_head": self.plan.embed_head}

    def resident_bytes(self) -> dict[str, int]:
        """Model-state bytes held by this rank, measured from the tensors: p, g, os and total."""
        out = {"p": 0, "g": 0, "os": 0}
        for u in self.units:
            for k, v in u.resident_bytes().items():
                out[k] += v
        out["total"] = out["p"] + out["g"] + out["os"]
        return out

    def named_fragments(self) -> list[Fragment]:
        """Per parameter, the piece of its fp32 master / exp_avg / exp_avg_sq this rank holds
        (see amsp/fragments.py). Pending spreads are completed first so weights and master agree."""
        self.finish_spread()
        return [f for u in self.units for f in unit_fragments(u)]

    def load_fragments(self, values: dict[str, dict[str, torch.Tensor]], optimizer_steps: int) -> None:
        """Restore every fragment of this rank (name -> {'master', 'exp_avg', 'exp_avg_sq'}, each the
        fragment's [start, end) piece), set the optimizer step count, and re-spread the compute
        weights from the masters. Collective: every rank must call it."""
        if self._accumulating:
            raise RuntimeError("AMSP: load_fragments() in the middle of a step")
        frags = self.named_fragments()
        missing = [f.name for f in frags if f.name not in values]
        if missing:
            raise KeyError(f"no saved values for fragments {missing}")
        for f in frags:
            load_fragment(f, values[f.name])
        self.optim.steps = optimizer_steps
        for u in self.units:
            u.version = optimizer_steps - 1  # the spread below brings every unit to this step
        self._spreads.start()
        self.finish_spread()
        self.comm.close_step()  # loading traffic is not part of a training step


_pageable_warned = False


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor (tokens or targets) on `device`, copied without blocking the host. A blocking copy
    to a GPU waits for the stream, twice per micro-batch, so the host could not queue the next kernels
    while the previous ones ran, serialising the overlap the engine builds. From page-locked memory
    (data/loader.py pins for CUDA) the copy is queued on the current stream, and torch's pinned allocator
    keeps the source block until that copy has run; nothing writes into a batch once the loader hands it
    out. From pageable memory CUDA stages the data before the call returns (correct, but the host may
    wait on the DMA): said once, since it means the batches bypassed the loader's pinning."""
    global _pageable_warned
    if device.type == "cuda" and batch.device.type == "cpu" and not _pageable_warned and not batch.is_pinned():
        _pageable_warned = True
        log.warning("AMSP: input batches arrive in pageable memory; their copy to %s cannot overlap GPU work "
                    "(data/loader.py MicroBatchLoader(pin_device=...) hands out pinned ones)", device)
    return batch.to(device, non_blocking=True)


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel() is a replicated DTensor: the caller gets its local value."""
    to_local = getattr(loss, "to_local", None)
    return to_local() if to_local is not None else loss
