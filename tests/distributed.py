"""The one helper every distributed test uses: spawn N gloo ranks on a free port, run a function.

Spawning costs seconds per rank (torch import), so tests run many cases inside one group: pass a
function that loops over cases and returns what each rank saw. Ranks start from a fork server that has
imported torch once (multiprocessing's "forkserver", torch preloaded): a fresh interpreter each, as with
"spawn", without each paying the import. The fork server keeps the environment it started with, so
each rank takes the caller's environment as it is at the call.

Each rank sets up what amsp.launch.init_distributed would: the control plane (amsp.control) with the
same timeout as the default group, and the routing checker when AMSP_CHECK_ROUTING=1 (tests/conftest.py
sets it), so test code sums its own CPU results through amsp.control, not raw dist calls.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank forks from this server (started at the first call) rather than importing torch itself.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, caller_env: dict, env: dict,
            queue) -> None:
    os.environ.clear()  # the fork server's environment is the one it started with: the caller's instead
    os.environ.update(caller_env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        from amsp import control, routing_check

        timeout = datetime.timedelta(seconds=float(env.get("TEST_PG_TIMEOUT", 120)))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        control.setup(timeout)
        routing_check.install_if_requested("cpu")
        result = fn(rank, world, *args)
        control.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0,
                    env: dict | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size gloo ranks; return per-rank results.

    fn must be importable at module level (it is pickled by name). Any rank's exception is
    re-raised here with its traceback; a group that does not finish in `timeout` is killed.
    """
    queue = _CONTEXT.Queue()
    port = free_port()
    procs = [_CONTEXT.Process(target=_worker, args=(r, world_size, port, fn, args, dict(os.environ), dict(env or {}),
                                                    queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish within {timeout:.0f}s "
                                   f"({len(results)} of {world_size} ranks done)")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not errors:
                    time.sleep(1.0)  # give a dying rank a moment to report its traceback
                    if queue.empty():
                        raise RuntimeError(f"ranks {dead} died without reporting (exit codes "
                                           f"{[procs[i].exitcode for i in dead]})")
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
