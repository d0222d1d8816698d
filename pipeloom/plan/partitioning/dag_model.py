"""One CP-SAT phase of the DAG partitioner (:func:`pipeloom.plan.partitioning.dag.partition_dag`): order-encoded
stage variables over the nodes whose window spans several stages, stage loads, and the cut bytes."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import ortools  # noqa: F401 - import OR-Tools before anything that may load SciPy
from ortools.sat.python import cp_model

from pipeloom.plan.partitioning.dag_graph import DagGraph, stage_loads
from pipeloom.search.cpsat import found_solution

__all__ = ["PhaseModel"]

_GAP_LIMIT = 1e-7
"""CP-SAT stops when the relative gap of a phase falls below this (rounding noise is larger)."""


class PhaseModel:
    """One CP-SAT phase over the nodes whose window spans several stages (integer units).

    Data: node i with time t_i, memory m_i, output bytes b_i, window [lo_i, hi_i], consumers C(i);
    stages k = 0..S-1; stage-time cap U; memory limit L.
    Variables (order encoding): g_ik = [stage_i > k] for lo_i <= k < hi_i, so stage_i = lo_i + Σ_k g_ik
    and x_ik = [stage_i = k] = g_i,k-1 - g_ik (with g_i,lo_i-1 = 1 and g_i,hi_i = 0).
    Phase ``time``: minimise T, load_k <= T <= U. Phase ``cut``: load_k <= U, minimise the cut bytes.
    """

    def __init__(self, g: DagGraph, lo: list[int], hi: list[int], *, cap: int, minimise: str,
                 hint: Sequence[int] | None) -> None:
        self.g, self.lo, self.hi, self.hint = g, lo, hi, hint
        self.model = cp_model.CpModel()
        self.gv = [[self.model.new_bool_var("") for _ in range(lo[i], hi[i])] for i in range(g.n)]
        self._monotone()
        self._precedence()
        loads = self._sums(g.t)
        if minimise == "time":
            self.objective = self.model.new_int_var(g.lower_bound(), cap, "T")
            for load in loads:
                self.model.add(load <= self.objective)
        else:
            for load in loads:
                self.model.add(load <= cap)
            self.objective = self._cut_bytes()
        self.model.minimize(self.objective)
        if g.limit is not None and g.m is not None:
            for used in self._sums(g.m):
                self.model.add(used <= g.limit)
        for count in self._sums([1] * g.n):
            self.model.add(count >= 1)
        if hint is not None:  # a complete hint: CP-SAT starts from it as a first solution
            for i, stage in enumerate(hint):
                for k, var in zip(range(lo[i], hi[i]), self.gv[i]):
                    self.model.add_hint(var, stage > k)
            if minimise == "time":
                self.model.add_hint(self.objective, max(stage_loads(g.t, hint, g.num_stages)))

    def x(self, i: int, k: int):
        """x_ik = [stage_i = k] as a constant or a linear expression."""
        lo, hi, gv = self.lo[i], self.hi[i], self.gv[i]
        if not lo <= k <= hi:
            return 0
        return (1 if k == lo else gv[k - 1 - lo]) - (gv[k - lo] if k < hi else 0)

    def _monotone(self) -> None:
        """g_i,k+1 => g_ik (a node past stage k+1 is past stage k)."""
        for gs in self.gv:
            for a, b in pairwise(gs):
                self.model.add_implication(b, a)

    def _precedence(self) -> None:
        """stage_u <= stage_v for each edge (u, v): g_uk => g_vk where both exist (windows already
        give lo_u <= lo_v and hi_u <= hi_v)."""
        for u, consumers in enumerate(self.g.succs):
            for v in consumers:
                for k in range(self.lo[v], self.hi[u]):
                    self.model.add_implication(self.gv[u][k - self.lo[u]], self.gv[v][k - self.lo[v]])

    def _sums(self, weights: Sequence[int]) -> list:
        """Per stage k: Σ_i w_i·x_ik = P_k - P_k-1 with prefix sums P_k = Σ_i w_i·[stage_i <= k] =
        Σ_i w_i·(1 - g_ik) (each g in one equality; fixed nodes and windows fold into constants)."""
        S, total = self.g.num_stages, sum(weights)
        step, local = [0] * (S + 1), [0] * S  # step: from k on; local: at k only
        terms: list[list] = [[] for _ in range(S)]
        coefs: list[list[int]] = [[] for _ in range(S)]
        for i, w in enumerate(weights):
            if w == 0:
                continue
            lo, gs = self.lo[i], self.gv[i]
            step[lo + len(gs)] += w  # [stage_i <= k] = 1 from hi_i on, 1 - g_ik inside the window
            for j, var in enumerate(gs):
                local[lo + j] += w
                terms[lo + j].append(var)
                coefs[lo + j].append(-w)
        hinted = None if self.hint is None else np.cumsum(stage_loads(weights, self.hint, S)).tolist()
        prefix: list[int | cp_model.IntVar] = [0]
        running = 0
        for k in range(S):
            running += step[k]
            if terms[k]:
                p = self.model.new_int_var(0, total, "")
                self.model.add(p == cp_model.LinearExpr.weighted_sum(terms[k], coefs[k]) + running + local[k])
                if hinted is not None:
                    self.model.add_hint(p, hinted[k])
                prefix.append(p)
            else:
                prefix.append(running + local[k])
        return [b - a for a, b in pairwise(prefix)]

    def _cut_bytes(self):
        """Σ_u b_u Σ_k y_uk with y_uk >= x_vk - x_uk for each consumer v: y_uk = 1 when stage k
        consumes u's output and u is not on k (fixed pairs fold into the constant)."""
        terms, weights, const = [], [], 0
        for u, consumers in enumerate(self.g.succs):
            b = self.g.b[u]
            if b == 0 or not consumers:
                continue
            for k in sorted({k for v in consumers for k in range(self.lo[v], self.hi[v] + 1)}):
                xu = self.x(u, k)
                if isinstance(xu, int) and xu == 1:
                    continue
                xs = [self.x(v, k) for v in consumers]
                if isinstance(xu, int) and any(isinstance(x, int) and x == 1 for x in xs):
                    const += b
                    continue
                y = self.model.new_bool_var("")
                if self.hint is not None:
                    h = self.hint
                    self.model.add_hint(y, h[u] != k and any(h[v] == k for v in consumers))
                for x in xs:
                    if not (isinstance(x, int) and x == 0):
                        self.model.add(y >= x - xu)
                terms.append(y)
                weights.append(b)
        return cp_model.LinearExpr.weighted_sum(terms, weights) + const

    def solve(self, seconds: float, workers: int) -> tuple[list[int] | None, bool, float]:
        """(stage per node or None, proven: optimal or infeasible, objective bound)."""
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.9 * seconds - 0.05, 0.05)  # loading takes time too
        solver.parameters.num_workers = workers
        solver.parameters.relative_gap_limit = _GAP_LIMIT
        solver.parameters.max_presolve_iterations = 1  # presolve gains little on this model and
        solver.parameters.cp_model_probing_level = 0  # takes seconds at 10,000 nodes
        status = solver.solve(self.model)
        if not found_solution(status):
            return None, status == cp_model.INFEASIBLE, 0.0
        stage_of = [lo + sum(solver.boolean_value(var) for var in gs) for lo, gs in zip(self.lo, self.gv)]
        bound = solver.best_objective_bound
        return stage_of, solver.objective_value - bound < 0.5, bound
