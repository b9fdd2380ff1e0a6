"""Module and parameter hooks that call the engine without keeping it alive.

Parameter hooks live in autograd's C++ objects, which Python's garbage collector cannot traverse: a hook
holding the engine (or a unit, which holds the parameters) closes a cycle engine -> model -> parameter ->
hook -> engine that no gc.collect() frees, so a dropped engine kept every byte of its device memory (seen
on an H100: 32 GB still allocated after the benchmark deleted the engine). These hooks hold the engine
weakly and its units by position in engine.units (tests/amsp/test_engine_lifetime.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from .flat_unit import FlatUnit


@dataclass(frozen=True)
class _UnitAt:
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
        position = {id(u): i for i, u in enumerate(engine.units)}

        def hook(method: str, *args) -> EngineHook:
            return cls(ref, method, tuple(_UnitAt(position[id(a)]) if isinstance(a, FlatUnit) else a for a in args))

        return hook

    def __call__(self, *hook_args):
        engine = self._engine()
        if engine is None:  # the engine is gone; its model may outlive it (e.g. the caller kept it)
            return None
        args = (engine.units[a.index] if isinstance(a, _UnitAt) else a for a in self._args)
        return getattr(engine, self._method)(*args, *hook_args)
