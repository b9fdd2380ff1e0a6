"""Module and parameter hooks that call the engine without keeping it alive.

Parameter hooks live in autograd's C++ objects, which Python's garbage collector cannot traverse: a hook
holding the engine (or a unit, which holds the parameters) closes a cycle engine -> model -> parameter ->
hook -> engine that no gc.collect() frees, so a dropped engine kept every byte of its device memory (seen
on an H100: 32 GB still allocated after the benchmark deleted the engine). These hooks hold the engine
weakly and its units and parameter slots by position (engine.units[i].slots[j]): a slot names its module,
so a parameter hook holding one closed the cycle parameter -> hook -> slot -> module -> parameter, and
every hooked module outlived the engine with its parameters and the flat buffers they view (the 3.6 GiB
of bf16 weights a deleted engine left on the H100). tests/amsp/test_engine_lifetime.py.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from .flat_unit import FlatUnit, ParamSlot


@dataclass(frozen=True)
class _UnitAt:
    index: int


@dataclass(frozen=True)
class _SlotAt:
    unit: int
    index: int


class EngineHook:
    __slots__ = ("_engine", "_method", "_args")

    def __init__(self, engine_ref: weakref.ref, method: str, args: tuple):
        self._engine, self._method, self._args = engine_ref, method, args

    @classmethod
    def factory(cls, engine) -> Callable[..., "EngineHook"]:
        """hook(method, *args) -> a hook calling engine.method(*args, *hook_args); units among args are
        kept by position. One weak reference and one position table for all of an engine's hooks."""
        ref = weakref.ref(engine)
        position = {id(u): _UnitAt(i) for i, u in enumerate(engine.units)}
        position.update({id(s): _SlotAt(i, j) for i, u in enumerate(engine.units) for j, s in enumerate(u.slots)})

        def hook(method: str, *args) -> EngineHook:
            return cls(ref, method, tuple(position[id(a)] if isinstance(a, (FlatUnit, ParamSlot)) else a
                                          for a in args))

        return hook

    def __call__(self, *hook_args):
        engine = self._engine()
        if engine is None:  # the engine is gone; its model may outlive it (e.g. the caller kept it)
            return None
        return getattr(engine, self._method)(*(_resolve(engine, a) for a in self._args), *hook_args)


def _resolve(engine, arg):
    if isinstance(arg, _UnitAt):
        return engine.units[arg.index]
    if isinstance(arg, _SlotAt):
        return engine.units[arg.unit].slots[arg.index]
    return arg
