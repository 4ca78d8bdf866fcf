"""CUDA-graph bucket grids (pure shape logic, CPU): every batch the engine's budgets allow lands
in a bucket that start-up warm-up captures, and the grids stay small."""

from __future__ import annotations

import itertools

import pytest

from cosyserve.models.graphs import BucketGrid, _pow2_buckets, half_octave_buckets, length_buckets


def test_length_buckets_are_fine_then_geometric():
    b = length_buckets(32, 4096)
    assert b[:8] == [32 * i for i in range(1, 9)]  # fine steps for short inputs
    assert b[-1] == 4096 and b == sorted(set(b)) and all(x % 32 == 0 for x in b)
    for lo, hi in zip(b[7:], b[8:]):  # then ~1.25x apart: at most 25% padding (+ one step)
        assert hi <= lo * 1.25 + 32
    assert len(b) <= 24
    assert length_buckets(32, 100) == [32, 64, 96, 128]  # the top rounded up to a step
    assert length_buckets(64, 64) == [64]
    with pytest.raises(ValueError):
        length_buckets(0, 10)


def test_bucket_grid_picks_the_smallest_bucket_holding_a_batch():
    g = BucketGrid(_pow2_buckets(6), [32, 64, 96], max_area=100)
    assert g.batches == [1, 2, 4, 6]
    assert g.pick(1, 1) == (1, 32) and g.pick(3, 33) == (4, 64) and g.pick(6, 96) == (6, 96)
    assert g.pick(7, 10) is None and g.pick(1, 97) is None  # beyond the grid: eager
    assert g.length(40) == 64 and g.length(500) == 500


@pytest.mark.parametrize("area,quad", [(None, None), (1, None), (100, None), (300, None), (4096, None),
                                       (None, 20000), (600, 40000)])
def test_reachable_buckets_cover_every_batch_within_the_budget(area, quad):
    """The buckets within the budgets (padded rows x length <= area, rows x length² <= quad, or
    one row of any length) are exactly those that batches the engine admits (``fits``) land
    in: warm-up captures all of them and nothing more."""
    g = BucketGrid(_pow2_buckets(8), length_buckets(16, 200, fine=4), max_area=area, max_quad=quad)
    def padded_ok(n, t):
        bb, lb = g.pick(n, t)
        return bb == 1 or ((area is None or bb * lb <= area) and (quad is None or bb * lb * lb <= quad))

    shapes = list(itertools.product(range(1, 9), range(1, 201)))
    assert {g.pick(n, t) for n, t in shapes if padded_ok(n, t)} == set(g.reachable())
    assert all(g.fits(n, t) == padded_ok(n, t) for n, t in shapes)
    assert not g.fits(9, 1) and not g.fits(1, g.lengths[-1] + 1)  # beyond the grid


def test_full_size_grids_stay_small():
    """The engine's default limits (64 streams, 4096 KV positions, 16384 token2wav tokens, 4096
    prefill positions) give graph counts that capture in tens of seconds."""
    flow = BucketGrid(half_octave_buckets(64), length_buckets(32, 4096), 16384, 16384 * 1024)
    hift = BucketGrid(half_octave_buckets(64), length_buckets(32, 2 * 4096 + 8), 2 * 16384 + 8 * 64)
    prefill = BucketGrid(_pow2_buckets(64), list(range(64, 1025, 64)), 4096)
    assert len(flow.reachable()) <= 160 and len(hift.reachable()) <= 200 and len(prefill.reachable()) <= 80


def test_half_octave_batch_buckets_pad_by_less_than_half():
    assert half_octave_buckets(64) == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert half_octave_buckets(6) == [1, 2, 4, 6] and half_octave_buckets(5) == [1, 2, 4, 5]
    assert half_octave_buckets(1) == [1] and half_octave_buckets(13) == [1, 2, 4, 6, 8, 12, 13]
    for top in (1, 5, 16, 48, 64, 100):
        b = half_octave_buckets(top)
        assert b == sorted(set(b)) and b[-1] == top
        assert all(next(x for x in b if x >= n) < max(4.5, n * 1.5) for n in range(1, top + 1))
    with pytest.raises(ValueError):
        half_octave_buckets(0)


def test_shared_buffers_give_every_bucket_a_view_of_one_allocation():
    """Buckets of one stage get views of the same memory, sized for the largest bucket; what
    does not fit (another dtype, a disproportionate shape) gets its own tensor."""
    import torch

    from cosyserve.models.graphs import SharedBuffers

    sh = SharedBuffers(max_units=4 * 100, device="cpu")
    a = sh.take("x", (1, 30, 8), torch.float32, units=1 * 30)  # sized from this first request
    b = sh.take("x", (4, 100, 8), torch.float32, units=4 * 100)  # the largest bucket fits
    assert a.data_ptr() == b.data_ptr() and sh.nbytes == 4 * 100 * 8 * 4
    assert not a.any()  # zeroed at allocation
    b.fill_(1)
    assert a.eq(1).all()  # the same memory: one stage runs one batch at a time
    c = sh.share("x", torch.full((2, 10, 8), 3.0), units=20)
    assert c.data_ptr() == a.data_ptr() and c.eq(3).all()
    odd = sh.take("x", (1, 30, 8), torch.float16, units=30)  # another dtype: its own memory
    big = sh.take("x", (4, 101, 9), torch.float32, units=4 * 101)  # larger than any bucket
    assert odd.data_ptr() != a.data_ptr() and big.data_ptr() != a.data_ptr() and sh.nbytes == 4 * 100 * 8 * 4
