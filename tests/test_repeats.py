"""The repeated-operations heuristic on plain token streams (no device)."""
import random

from torch_tpu.eager.repeats import segments


def _blocks(prefix, block, n, suffix):
    return prefix + block * n + suffix


def _check_cover(segs, n):
    assert segs[0][0] == 0 and segs[-1][1] == n
    for (a, b), (c, d) in zip(segs, segs[1:]):
        assert b == c and a < b


def test_transformer_like_stream_is_cut_at_block_boundaries():
    """prefix + 12 identical blocks + suffix: one segment per block, all blocks the same length."""
    block = list(range(100, 130))
    tokens = _blocks([1, 2, 3], block, 12, [7, 8, 9, 10])
    segs = segments(tokens, min_period=16)
    _check_cover(segs, len(tokens))
    units = [tokens[a:b] for a, b in segs]
    assert units.count(block) == 12
    assert units[0] == [1, 2, 3] and units[-1] == [7, 8, 9, 10]


def test_two_and_twelve_blocks_give_the_same_distinct_units():
    """The set of distinct segments does not grow with depth."""
    block = list(range(100, 125))
    distinct = []
    for depth in (2, 12):
        tokens = _blocks([1, 2], block, depth, [3, 4, 5])
        distinct.append({tuple(tokens[a:b]) for a, b in segments(tokens, min_period=16)})
    assert distinct[0] == distinct[1]
    assert len(distinct[1]) == 3


def test_forward_and_backward_runs_are_both_found():
    """Two different repeating runs (forward blocks, then backward blocks) are each cut."""
    fwd, bwd = list(range(100, 120)), list(range(200, 240))
    tokens = [1] + fwd * 4 + [2, 3] + bwd * 4 + [4]
    units = [tuple(tokens[a:b]) for a, b in segments(tokens, min_period=16)]
    assert units.count(tuple(fwd)) == 4 and units.count(tuple(bwd)) == 4


def test_short_periods_are_grouped_to_min_period():
    """A 4-op loop body repeated 100 times is cut into units of 16 ops (4 bodies), never shorter."""
    body = [5, 6, 7, 8]
    tokens = body * 100
    segs = segments(tokens, min_period=16)
    _check_cover(segs, len(tokens))
    lengths = [b - a for a, b in segs]
    assert lengths.count(16) == 25


def test_no_repetition_means_one_segment():
    """A stream with no repeats stays whole."""
    rng = random.Random(0)
    tokens = [rng.randrange(10**9) for _ in range(300)]
    assert segments(tokens, min_period=16) == [(0, 300)]
    assert segments([], min_period=16) == []
    assert segments([1, 1, 1], min_period=16) == [(0, 3)]


def test_a_single_repetition_is_not_cut():
    """min_repeats=2: a block that appears once is not a repeating run."""
    tokens = list(range(50)) + list(range(1000, 1040))
    assert segments(tokens, min_period=16) == [(0, 90)]


def test_blocks_inside_repeated_steps_are_cut_too():
    """Two training steps recorded in one graph: cut per step and per block inside each step."""
    fwd, bwd = list(range(100, 120)), list(range(200, 240))
    step = [1] + fwd * 3 + [2] + bwd * 3 + [3, 4]
    tokens = step * 2 + [9]
    units = [tuple(tokens[a:b]) for a, b in segments(tokens, min_period=16)]
    assert units.count(tuple(fwd)) == 6 and units.count(tuple(bwd)) == 6
    assert len(set(units)) <= 6
