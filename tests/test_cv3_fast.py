"""Issue 20 (CosyVoice3 serving speed): the fast paths keep upstream's numerics.

* the DiT's cached rotary tables equal freshly computed ones and attention stays SDPA;
* :class:`~cosyserve.models.graphs.GraphedFlow`'s captured functions (run eagerly here) equal the
  eager CosyVoice3 flow, full and streaming calls;
* the causal HiFT over a bounded window with the carried phase (:class:`CausalHiFTStream`) equals
  the whole-mel re-run (reference streaming cases within 1e-4, long streams far tighter);
* concurrent CosyVoice3 streams' chunk jobs go through one flow call.

Cases are discovered from the CosyVoice3 reference set (:mod:`_reference_cv3`); GPU tests are
marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from cosyserve.models.config import load_hyperpyyaml
from cosyserve.models.cv3_flow import load_cv3_flow, parse_cv3_flow, rotary_tables
from cosyserve.models.hift import load_hift, parse_causal_hift

from _reference import check_close
from _reference_cv3 import discover, meta, model_dir, require_cv3_dir, tensors

FLOW_CASES = discover("flow", has=("token", "prompt_token", "prompt_feat", "embedding", "mel"))
HIFT_STREAM_CASES = discover("hift", has=("mel",), where=lambda m: bool(m.get("calls")))
STREAM_CASES = discover("stream", has=("source_speech_token", "prompt_token", "prompt_feat", "embedding"),
                        where=lambda m: bool(m.get("chunks")))


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def yaml_data():
    require_cv3_dir()
    return load_hyperpyyaml(model_dir() / "cosyvoice3.yaml")


@pytest.fixture(scope="module")
def flow(yaml_data):
    return load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data))


@pytest.fixture(scope="module")
def hift(yaml_data):
    return load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data))


# ----------------------------------------------------------------------------------------------
# 1. attention
# ----------------------------------------------------------------------------------------------


def test_rotary_cache_equals_fresh_tables(flow):
    est = flow.decoder.estimator
    est._rotary_cache = None
    inv = est.rotary_embed.inv_freq
    for n, start in ((7, 0), (300, 0), (50, 250), (1, 0), (1025, 3)):  # grows the cache in between
        cos, sin = est.rotary(n, start)
        ref_cos, ref_sin = rotary_tables(inv, start + n)
        assert cos.shape == (n, est.cfg.dim_head) and cos.dtype == torch.float32
        assert torch.equal(cos, ref_cos[start:]) and torch.equal(sin, ref_sin[start:])
    assert est._rotary_cache[0].shape[0] >= 1028


def test_attention_is_one_sdpa_call_per_layer(flow, monkeypatch):
    """No per-head loop: each DiT block calls scaled_dot_product_attention once for all heads."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), attn_mask.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    est = flow.decoder.estimator
    n = est.cfg.mel_dim
    t = 60
    with torch.inference_mode():
        est(torch.randn(2, n, t), torch.ones(2, 1, t), torch.randn(2, n, t), torch.rand(2), torch.randn(2, n),
            torch.randn(2, n, t), streaming=True)
    assert len(calls) == est.cfg.depth
    assert all(shape == (2, est.cfg.heads, t, est.cfg.dim_head) and dt == torch.bool for shape, dt in calls)
