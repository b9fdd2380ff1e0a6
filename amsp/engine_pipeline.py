"""The AMSP engine's API for a pipeline schedule that runs the forwards and backwards itself
(amsp/parallel/pipeline.py): each backward through a pipeline chunk's units is one micro-batch of that
chunk, and its num_micro-th runs the chunk's gradient sync. A mixin of AMSPEngine (amsp/engine.py), whose
hooks keep the per-chunk micro-batch states this opens, checks and closes."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .flat_unit import FlatUnit


class PipelineMicroBatches:
    """begin_microbatches / end_microbatches around a schedule's step, and the deferred weight pass of
    zero-bubble schedules (gather_for_weight_pass, weight_grads_ready)."""

    def begin_microbatches(self, num_micro: int, deferred_weights: bool = False) -> None:
        """For a pipeline schedule that runs forwards and backwards itself: from now until
        end_microbatches(), each backward through a chunk's units is one micro-batch of that chunk, and
        its num_micro-th runs the chunk's gradient sync. The caller scales each micro-batch loss by
        1 / (num_micro * data-parallel size). deferred_weights: the schedule splits each backward into
        an input-gradient pass and a later weight pass (zero-bubble schedules); a weight pass that sets
        .grad without autograd's accumulation (so no parameter hook fires) is reported through
        weight_grads_ready()."""
        if num_micro < 1:
            raise ValueError(f"num_micro must be >= 1, got {num_micro}")
        self._check_live()
        if self._pipeline is not None or self._accumulating:
            raise RuntimeError("AMSP: begin_microbatches() in the middle of a step")
        self._pipeline = {"expected": num_micro, "seen": {}, "states": {}, "deferred": deferred_weights}

    def gather_for_weight_pass(self, chunk: int) -> None:
        """Before a deferred weight pass of pipeline chunk `chunk`: its units' weights gathered (p > 1). The
        pass is one autograd.grad over the chunk, and fused backward ops that compute the input and weight
        gradients together (RMSNorm's) read the weights again; each unit is freed when its gradients
        are taken, as after any backward. With p > 1 that is one more all-gather per unit and micro-batch
        than under the other schedules, and the chunk's weights are whole at once during the pass."""
        units = self._chunk_units_backward(chunk)
        for u in units:
            self._ensure_fresh(u)
            u.start_gather("backward")
        for u in units:
            u.wait_gather("backward")

    def weight_grads_ready(self, chunk: int) -> None:
        """A deferred weight pass of pipeline chunk `chunk` left one micro-batch's gradients in .grad of
        its parameters (torch.distributed.pipelining's stage_backward_weight assigns them): take each as
        its post-accumulate hook would have, in backward order, so every data-parallel rank of the stage
        issues the same collectives in the same order."""
        if self._pipeline is None or not self._pipeline["deferred"]:
            raise RuntimeError("AMSP: weight_grads_ready() outside begin_microbatches(deferred_weights=True)")
        units = self._chunk_units_backward(chunk)
        missing = [s.name for u in units for s in u.slots if u.param(s).grad is None]
        if missing:
            raise RuntimeError(f"AMSP: the weight pass of pipeline chunk {chunk} left no gradient for {missing}")
        for u in units:
            for s in u.slots:
                self._grad_ready(u, s, u.param(s))

    def _chunk_units_backward(self, chunk: int) -> list[FlatUnit]:
        return [u for u in self._bwd_order if self._chunk[id(u)] == chunk]

    def abort_microbatches(self) -> None:
        """After a failed schedule: leave pipeline mode without the checks (the failure is the news)."""
        self._pipeline = None
        self._micro_state = None

    def end_microbatches(self) -> None:
        """After the schedule: every chunk ran exactly num_micro complete backward passes."""
        pipe, self._pipeline = self._pipeline, None
        if pipe is None:
            raise RuntimeError("AMSP: end_microbatches() without begin_microbatches()")
        chunks = sorted(set(self._unit_chunks))
        short = {c: pipe["seen"].get(c, 0) for c in chunks if pipe["seen"].get(c, 0) != pipe["expected"]}
        if short or pipe["states"]:
            raise RuntimeError(f"AMSP: pipeline chunks ran {short or 'incomplete'} backward passes, expected "
                               f"{pipe['expected']} each")
        self._accumulating = True
        self._synced_last = True

    def _end_chunk_backward(self, chunk: int, st: dict) -> None:
        self._drain(st)
        del self._pipeline["states"][chunk]
        self._pipeline["seen"][chunk] = self._pipeline["seen"].get(chunk, 0) + 1
