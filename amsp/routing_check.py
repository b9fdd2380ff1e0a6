"""Opt-in checker (AMSP_CHECK_ROUTING=1) that every collective keeps to its plane.

The contract (DESIGN.md section 2, "Two planes"):
- a call on a control-plane group (amsp.control: the control group, or a CPU group it made)
  carries CPU tensors only, or objects;
- a call on any other group (WORLD or a data subgroup) is a data-plane call, made inside
  `data_plane()` (amsp.collectives.Comm and the probe's timed collectives mark theirs), with its
  tensors on the data plane's device.
gloo accepts CPU tensors on any group, so on CPU a control value sent to WORLD works and the bug
shows only on GPUs, where NCCL refuses it at the first step; the checker fails it on CPU too.

install() replaces the collective functions of torch.distributed and of
torch.distributed.distributed_c10d (the two places code looks them up), and rebinds the aliases
that amsp modules imported already took (amsp.collectives' _all_gather, for one). A collective
that torch runs inside another (all_gather_object's all_gather) is judged by the outer call only.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import control

log = logging.getLogger(__name__)

ENV = "AMSP_CHECK_ROUTING"
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object", "gather_object",
    "broadcast_object_list", "scatter_object_list", "send_object_list", "recv_object_list", "send", "recv",
    "isend", "irecv", "batch_isend_irecv",
)
_OBJECT_ARGS = ("object_list", "obj", "object_gather_list", "scatter_object_output_list",
                "scatter_object_input_list")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)

_state = threading.local()  # .data: inside data_plane(); .depth: collectives in progress
_installed: dict = {}  # name -> original function; "device" -> the data plane's device type


class RoutingError(AssertionError):
    """A collective broke the two-plane contract."""


class data_plane:
    """Marks the collectives issued inside as data-plane calls (cheap: two attribute writes)."""

    __slots__ = ("_outer",)

    def __enter__(self):
        self._outer = getattr(_state, "data", False)
        _state.data = True
        return self

    def __exit__(self, *exc):
        _state.data = self._outer
        return False


def requested() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


def install_if_requested(data_device_type: str) -> bool:
    if requested():
        install(data_device_type)
        return True
    return False


def installed() -> bool:
    return bool(_installed)


def install(data_device_type: str) -> None:
    """Wrap every collective of torch.distributed (idempotent; the device type can be updated)."""
    first = not _installed
    _installed["device"] = data_device_type
    if not first:
        return
    wrappers = {}
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:  # not in this torch version
            continue
        _installed[name] = original
        wrapper = _wrap(name, original)
        wrappers[id(original)] = (original, wrapper)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    # Aliases taken at import (`_all_gather = dist.all_gather_single`) still name the originals.
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == "amsp" or modname.startswith("amsp.")):
            continue
        for attr, value in list(vars(mod).items()):
            hit = wrappers.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, attr, hit[1])
    log.info("routing check on (%s=1): control groups carry CPU values, every other group only "
             "data-plane calls on %s tensors", ENV, data_device_type)


def _wrap(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def checked(*args, **kwargs):
        depth = getattr(_state, "depth", 0)
        if depth == 0:
            _check(name, signature, args, kwargs)
        _state.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _state.depth = depth

    return checked


def _tensors(value, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    return out


def _check(name: str, signature, args, kwargs) -> None:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return  # torch itself reports a wrong call
    a = bound.arguments
    if name == "batch_isend_irecv":
        for op in a.get("p2p_op_list") or []:
            _judge(name, op.group, [op.tensor], objects=False, device=None)
        return
    objects = any(k in a for k in _OBJECT_ARGS)
    tensors = [] if objects else _tensors([v for k, v in a.items() if k not in ("group", "device_ids")], [])
    _judge(name, a.get("group"), tensors, objects, a.get("device") if objects else None)


def _judge(name: str, group, tensors: list, objects: bool, device) -> None:
    data = getattr(_state, "data", False)
    if control.is_cpu_group(group):
        if data:
            _fail(name, group, tensors, "a data-plane call (Comm / probe) on a control-plane group")
        bad = [t for t in tensors if t.device.type != "cpu"]
        if device is not None and torch.device(device).type != "cpu":
            _fail(name, group, tensors, f"an object collective on a control-plane group staged on {device}")
        if bad:
            _fail(name, group, bad, "a control-plane group carries CPU tensors only")
        return
    if not data:
        _fail(name, group, tensors, "a collective on a data-plane group outside amsp.collectives.Comm: control "
                                    "values (signals, losses, norms, flags, objects) go through amsp.control")
    if objects:
        _fail(name, group, tensors, "an object collective on a data-plane group (objects go through amsp.control)")
    want = _installed["device"]
    bad = [t for t in tensors if t.device.type != want]
    if bad:
        _fail(name, group, bad, f"data-plane tensors must be on the data plane's device ({want})")


def _fail(name: str, group, tensors: list, why: str) -> None:
    raise RoutingError(f"routing check: dist.{name} at {_call_site()} on {_describe_group(group)} with "
                       f"{_describe_tensors(tensors)}: {why}")


def _call_site() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE and not path.startswith(_TORCH_DIR + os.sep):
            shown = os.path.relpath(path, _ROOT) if path.startswith(_ROOT + os.sep) else path
            return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown"


def _describe_group(group) -> str:
    if group is None or group is dist.group.WORLD:
        return f"WORLD (backend {dist.get_backend()})"
    try:
        ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        return repr(group)
    kind = "control group" if control.is_cpu_group(group) else "group"
    return f"{kind} of ranks {ranks} (backend {backend})"


def _describe_tensors(tensors: list) -> str:
    if not tensors:
        return "no tensors"
    shown = ", ".join(f"{t.device}/{t.dtype} {tuple(t.shape)}" for t in tensors[:3])
    return f"tensors [{shown}{', ...' if len(tensors) > 3 else ''}]"
