"""The per-group cost terms that both solvers combine, computed once per (model, cluster).

For each unit group and each valid degree triple: exposed seconds, model-state bytes and, per role,
the bytes of one gathered unit, of one unit's in-flight parameter spread and of one unit's gradient
bucket. The step time of a plan is `constant_s` plus the two groups' exposed seconds; its memory is
the two groups' state bytes, the spread window (spread_window times the largest unit's spread
transient) and the larger of two phases: forward/backward (the largest simultaneously gathered pair
of units, the largest bucket event (held gradient buckets plus the gradient in copy) or the loss
backward's transient `bucket_floor`, and
the degree-independent activations) or the optimizer step (the OS-shard gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amsp.plan import Degrees, UNIT_GROUPS

from .cost_model import CostModel


@dataclass
class GroupTerms:
    candidates: list[Degrees]
    exposed_s: np.ndarray  # [group index, candidate]
    state_bytes: np.ndarray  # [group index, candidate]: params, grads, optimizer states (always held)
    sync_bytes: np.ndarray  # [group index, candidate]: OS-shard gradients held at the optimizer step only
    gathered: dict  # role -> np.ndarray over candidates (bytes of one gathered unit of that role)
    spread: dict  # role -> np.ndarray over candidates (bytes of one unit's in-flight spread)
    buckets: dict  # role -> np.ndarray over candidates (bytes of one unit's gradient bucket)
    fills: dict  # role -> np.ndarray over candidates (the gradient in copy while that unit fills)
    inflight: dict  # role -> np.ndarray over candidates (its reduce-scatter beyond the bucket, in flight)
    sync_copy: dict  # role -> np.ndarray over candidates (gloo's copy while its G->OS sync is in flight)
    bucket_floor: float  # the buckets' term is at least this (the unfused loss backward's transient)
    bucket_events: list  # (roles held, role filling, bytes credited): cost_model.bucket_events
    spread_window: int  # units whose spread may be in flight at once
    spread_in_forward: bool  # the spread overlaps the next forward (else it follows the update)
    role_group: dict  # role -> group index
    pairs: list  # tuples of roles gathered together
    constant_s: float
    constant_bytes: float
    budget_bytes: float
    state_budget_bytes: float  # cap on the two groups' state bytes (inf: none)

    @classmethod
    def build(cls, model: CostModel) -> "GroupTerms":
        cands = model.candidates()
        exposed = np.zeros((len(UNIT_GROUPS), len(cands)))
        state = np.zeros((len(UNIT_GROUPS), len(cands)))
        sync = np.zeros((len(UNIT_GROUPS), len(cands)))
        gathered: dict = {}
        spread: dict = {}
        buckets: dict = {}
        fills: dict = {}
        inflight: dict = {}
        sync_copy: dict = {}
        role_group: dict = {}
        for gi, group in enumerate(UNIT_GROUPS):
            for ci, d in enumerate(cands):
                gc = model.group_cost(group, d)
                exposed[gi, ci], state[gi, ci], sync[gi, ci] = gc.exposed_s, gc.state_bytes, gc.sync_bytes
                for role, b in gc.gathered_bytes.items():
                    gathered.setdefault(role, np.zeros(len(cands)))[ci] = b
                    role_group[role] = gi
                for role, b in gc.spread_bytes.items():
                    spread.setdefault(role, np.zeros(len(cands)))[ci] = b
                for role, b in gc.bucket_bytes.items():
                    buckets.setdefault(role, np.zeros(len(cands)))[ci] = b
                for role, b in gc.fill_bytes.items():
                    fills.setdefault(role, np.zeros(len(cands)))[ci] = b
                for role, b in gc.inflight_bytes.items():
                    inflight.setdefault(role, np.zeros(len(cands)))[ci] = b
                for role, b in gc.sync_copy_bytes.items():
                    sync_copy.setdefault(role, np.zeros(len(cands)))[ci] = b
        return cls(cands, exposed, state, sync, gathered, spread, buckets, fills, inflight, sync_copy,
                   model.w.loss_backward_transient_bytes(), model.bucket_events(),
                   model.spread_window, model.o.overlap_spread, role_group, model.buffer_pairs(),
                   model.constant_time_s(), sum(model.constant_memory().values()), model.memory_budget(),
                   np.inf if model.o.state_budget_bytes is None else float(model.o.state_budget_bytes))

    def to_json(self) -> dict:
        """Every candidate triple of each unit group with its terms (what the ILP combines: a plan's
        step is constant_s plus its two groups' exposed seconds; its memory is their state bytes plus
        the largest transients and constant_bytes), for the CLI's --json."""
        out: dict = {"constant_s": self.constant_s, "constant_bytes": self.constant_bytes,
                     "budget_bytes": self.budget_bytes}
        for gi, group in enumerate(UNIT_GROUPS):
            roles = sorted(r for r, g in self.role_group.items() if g == gi)
            out[group] = [{"p": d.p, "g": d.g, "os": d.os, "exposed_s": float(self.exposed_s[gi, ci]),
                           "state_bytes": float(self.state_bytes[gi, ci]), "sync_bytes": float(self.sync_bytes[gi, ci]),
                           **{f"{kind}_bytes": {r: float(table[r][ci]) for r in roles if r in table}
                              for kind, table in (("gathered", self.gathered), ("spread", self.spread),
                                                  ("bucket", self.buckets), ("fill", self.fills),
                                                  ("inflight", self.inflight), ("sync_copy", self.sync_copy))}}
                          for ci, d in enumerate(self.candidates)]
        return out

