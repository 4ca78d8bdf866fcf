"""Chunk schedules: the upstream default reproduces the reference stream's chunks."""

from __future__ import annotations

import pytest

from _reference import discover, meta, tensors
from cosyserve.engine.chunking import ChunkPolicy

STREAM_CASES = discover("stream", has=("source_speech_token", "prompt_token"))


def plan(policy: ChunkPolicy, n_prompt: int, n_tokens: int):
    """(n_tokens passed, token_offset, finalize) of every chunk for n_tokens known tokens."""
    s = policy.start(n_prompt)
    out = []
    while s.ready(n_tokens):
        out.append((s.chunk_end(), s.token_offset, False))
        s.advance()
    out.append((n_tokens, s.token_offset, True))
    return out


@pytest.mark.parity
@pytest.mark.parametrize("case", STREAM_CASES)
def test_upstream_schedule_matches_reference(case):
    m, d = meta(case), tensors(case)
    rules = m["schedule_rules"]
    policy = ChunkPolicy("upstream", base=rules["token_hop_len_initial"], max_hop=rules["token_max_hop_len"],
                         scale=rules["stream_scale_factor"], lookahead=rules["pre_lookahead_len"])
    got = plan(policy, d["prompt_token"].shape[-1], d["source_speech_token"].shape[-1])
    want = [(c["n_tokens"], c["token_offset"], c["finalize"]) for c in m["chunks"]]
    assert got == want


def test_upstream_first_hop_aligns_prompt_to_chunk():
    p = ChunkPolicy()
    for n_prompt in (0, 1, 24, 25, 26, 87, 150):
        s = p.start(n_prompt)
        assert (n_prompt + s.hop) % 25 == 0 and 25 <= s.hop < 50
    s = p.start(50)
    hops = []
    for _ in range(5):
        hops.append(s.hop)
        s.advance()
    assert hops == [25, 50, 100, 100, 100]


def test_triton_schedules():
    s = ChunkPolicy.parse("exponential").start(87)
    hops = []
    for _ in range(5):
        hops.append(s.hop)
        s.advance()
    assert hops == [15, 25, 50, 100, 200]
    s = ChunkPolicy.parse("exponential:15:25:100").start(0)
    for _ in range(5):
        s.advance()
    assert s.hop == 100
    s = ChunkPolicy.parse("fixed:15").start(87)
    assert [s.hop for _ in range(3) if not s.advance()] == [15, 15, 15]
    assert not s.ready(s.token_offset + 17) and s.ready(s.token_offset + 18)


@pytest.mark.parametrize("spec", ["bogus", "fixed:0", "upstream:x"])
def test_bad_policy(spec):
    with pytest.raises(ValueError):
        ChunkPolicy.parse(spec)
