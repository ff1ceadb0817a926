"""The repeated-operations heuristic of DeferAndFuse: where to cut a recorded graph.

A recorded op stream is a sequence of tokens (one per op: which cached op
program it ran, so equal tokens mean the same op on the same shapes). A
transformer stack records the same block of tokens once per layer; fusing the
whole stack into one program would make compile time grow with depth and give
every depth its own program. Instead the stream is cut at the boundaries of
repeating runs, so one compiled program serves every repetition.

`segments(tokens, ...)` returns the cut points. Greedy and deterministic:
among all periods p <= max_period, find the run of consecutive repetitions
that covers the most ops (ties: the shorter period, then the earliest
start), cut it into units of k periods (k = ceil(min_period / p) so no unit
is shorter than `min_period` ops) if at least `min_repeats` units result,
cut the inside of one unit the same way and apply those cuts to every unit
(blocks inside repeated training steps), then do the same on the parts to
its left and right. Parts that repeat nothing stay whole. Only the cut points
come from here: whether two units really share a program is decided by their
full fingerprint (wiring included), so a wrong guess costs a compile, never a
wrong result.

Pure NumPy, no device: cost is O(len(tokens) * max_period) vectorised
comparisons, paid once per new graph fingerprint.
"""
from __future__ import annotations

import numpy as np


def _best_run(tokens: np.ndarray, max_period: int, min_repeats: int):
    """(start, period, repeats) of the repeating run covering the most ops, or None."""
    n = len(tokens)
    best = None  # (covered, -period, -start)
    for period in range(1, min(max_period, n // min_repeats) + 1):
        equal = tokens[period:] == tokens[:-period]
        if not equal.any():
            continue
        # Maximal stretches of True in `equal`: a stretch [a, b) means ops a .. b+period-1 repeat with this period.
        edges = np.diff(np.concatenate(([0], equal.view(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        lengths = ends - starts
        repeats = 1 + lengths // period
        ok = repeats >= min_repeats
        if not ok.any():
            continue
        covered = np.where(ok, repeats * period, 0)
        i = int(np.argmax(covered))  # first (earliest) among the longest
        candidate = (int(covered[i]), -period, -int(starts[i]))
        if best is None or candidate > best:
            best = candidate
    if best is None:
        return None
    covered, neg_period, neg_start = best
    return -neg_start, -neg_period, covered // -neg_period


def segments(tokens, min_period: int = 16, max_period: int = 1024, min_repeats: int = 2) -> list[tuple[int, int]]:
    """Cut `tokens` into [start, end) segments at the boundaries of repeating runs (covers the whole stream)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    if n == 0:
        return []
    cuts = _cuts(tokens, 0, n, min_period, max_period, min_repeats)
    points = sorted(c for c in cuts if 0 < c < n)
    bounds = [0, *points, n]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _cuts(tokens, lo: int, hi: int, min_period: int, max_period: int, min_repeats: int) -> set[int]:
    """Cut points inside [lo, hi): the best run's unit boundaries, the unit's own cuts, then both sides."""
    if hi - lo < min_period * min_repeats:
        return set()
    found = _best_run(tokens[lo:hi], max_period, min_repeats)
    if found is None:
        return set()
    start, period, repeats = found
    unit = -(-min_period // period) * period  # ops per unit: whole periods, at least min_period ops
    units = repeats * period // unit
    first = lo + start
    if units < min_repeats:  # repeats, but too few times at this length: leave the run whole
        last = first + repeats * period
        return (_cuts(tokens, lo, first, min_period, max_period, min_repeats)
                | _cuts(tokens, last, hi, min_period, max_period, min_repeats))
    last = first + units * unit
    # Units are equal token sequences: a repeating structure inside one (blocks inside a repeated
    # training step) is cut the same way in every unit.
    inner = [c - first for c in _cuts(tokens, first, first + unit, min_period, max_period, min_repeats)]
    cuts = set(range(first, last + 1, unit))
    for u in range(first, last, unit):
        cuts.update(u + c for c in inner)
    return (cuts | _cuts(tokens, lo, first, min_period, max_period, min_repeats)
            | _cuts(tokens, last, hi, min_period, max_period, min_repeats))
