"""Per-rank micro-batches with background prefetch, resumable by consumed-sample count.

A thread reads ahead into a bounded queue while the training step runs; the time the loop spends
waiting on that queue is accumulated so the log line can report it. The loader's whole state is the
number of global samples consumed by completed steps, which the checkpoint stores.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Sequence

import numpy as np
import torch

from data.sampling import micro_batch_indices, rank_block

_DONE = object()


def collate(rows: Sequence[np.ndarray], pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_len + 1 tokens per sample -> (inputs, targets), each (batch, seq_len) int64.

    pin: each in page-locked memory and contiguous, so that its copy to a GPU can be non-blocking. (The
    unpinned pair are views of one array; torch copies a strided source to the GPU through a pageable
    contiguous copy, which the host waits for, so pinned views would gain nothing.)"""
    batch = torch.from_numpy(np.stack(rows))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if pin:
        return _pinned(inputs), _pinned(targets)
    return inputs, targets


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous page-locked copy (one copy, where .contiguous().pin_memory() makes two)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def pin_device_for(device: torch.device | str | None) -> torch.device | None:
    """The device batches are pinned for: CUDA only. A page-locked batch is what lets the copy to a GPU
    run without the host waiting for the stream (amsp/engine.py to_device); for the CPU there is no copy,
    and pinning would start a CUDA context on a machine that has one but trains on the CPU."""
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


class MicroBatchLoader:
    def __init__(self, source, global_batch: int, micro_batch: int, rank: int = 0, world: int = 1,
                 consumed_samples: int = 0, prefetch: int = 4, pin_device: torch.device | str | None = None):
        """pin_device: the device the batches will be copied to (train.py passes the run's device); for a
        CUDA device they are handed out page-locked (pin_device_for), pinned by the prefetch thread."""
        self.source, self.global_batch, self.micro_batch = source, global_batch, micro_batch
        self.rank, self.world, self.prefetch = rank, world, max(1, prefetch)
        self.pin_device = pin_device_for(pin_device)
        micro_batch_indices(0, global_batch, micro_batch, rank, world)  # validates the geometry now
        self.micro_per_step = global_batch // world // micro_batch
        self._wait = 0.0
        self._thread: threading.Thread | None = None
        self._start(consumed_samples)

    # ---- producer ----
    def _start(self, consumed: int) -> None:
        self.consumed_samples = consumed
        self._taken = 0  # micro-batches handed out in the current step
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(consumed, self._queue, self._stop),
                                        name=f"data-prefetch-rank{self.rank}", daemon=True)
        self._thread.start()

    def _produce(self, consumed: int, q: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            pin = self.pin_device is not None
            if pin and self.pin_device.index is not None:
                # The current CUDA device is per thread. As in torch's DataLoader pin thread: pinning before
                # the training thread has touched its GPU would otherwise make a context on GPU 0, on every
                # rank of a node.
                torch.cuda.set_device(self.pin_device)
            while True:
                for idx in micro_batch_indices(consumed, self.global_batch, self.micro_batch, self.rank, self.world):
                    if idx[-1] >= len(self.source):
                        put(_DONE)
                        return
                    if not put(collate([self.source[int(i)] for i in idx], pin=pin)):
                        return
                consumed += self.global_batch
        except BaseException as e:  # handed to the training loop, which re-raises it
            put(e)

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # ---- consumer ----
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        item = self._queue.get()
        self._wait += time.perf_counter() - t0
        if item is _DONE:
            self._queue.put(_DONE)
            raise StopIteration(f"rank {self.rank}: samples exhausted after {self.consumed_samples} consumed "
                                f"(the dataset was built with {len(self.source)})")
        if isinstance(item, BaseException):
            raise item
        self._taken += 1
        if self._taken == self.micro_per_step:  # the step's last micro-batch: its samples are consumed
            self._taken = 0
            self.consumed_samples += self.global_batch
        return item

    def take_wait_seconds(self) -> float:
        """Seconds spent waiting for data since the previous call."""
        w, self._wait = self._wait, 0.0
        return w

    # ---- checkpointing ----
    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.consumed_samples)}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._start(int(state["consumed_samples"]))


def validation_rounds(available: int, micro_batch: int, world: int, num_samples: int | None = None) -> tuple[int, int]:
    """(rounds, samples per round) a validation pass covers: whole rounds of micro_batch x world samples out
    of the first num_samples of `available` (validation_batches' geometry)."""
    total = available if num_samples is None else min(num_samples, available)
    per_round = micro_batch * world
    return total // per_round, per_round


def validation_batches(source, micro_batch: int, rank: int = 0, world: int = 1, num_samples: int | None = None,
                       pin_device: torch.device | str | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches over the first num_samples validation samples (whole batches only).

    Samples [k*B, (k+1)*B) with B = micro_batch * world form round k; each rank takes its block, so
    the ranks together cover every validation sample once. pin_device: as MicroBatchLoader's.
    """
    pin = pin_device_for(pin_device) is not None
    rounds, per_round = validation_rounds(len(source), micro_batch, world, num_samples)
    for start in range(0, rounds * per_round, per_round):
        block = rank_block(start, per_round, rank, world)
        yield collate([source[i] for i in block], pin=pin)
