"""Speech LM parity with upstream ``Qwen2LM`` on every reference LLM case."""

from __future__ import annotations


import pytest
import torch

from _reference import (SELF_TOL, check_close, discover, full_size_config, manifest, manifest_shapes, meta, model_dir,
                        rel_l2, tensors)
from cosyserve.errors import CheckpointError
from cosyserve.models.checkpoint import load_strict, read_state_dict
from cosyserve.models.config import load_config
from cosyserve.models.llm import KVCache, SpeechLM
from cosyserve.models.loader import load_llm, open_model_dir

TEACHER_CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token", "target_speech_token", "logp"))
SEEDED_CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token", "sampled_speech_token"))


@pytest.fixture(scope="module")
def lm():
    md = open_model_dir(model_dir(), need=("llm",))
    return load_llm(md, load_config(md.yaml))


def _teacher_forced(lm: SpeechLM, d: dict, cache: KVCache, slot: int):
    prefix = lm.embed_prefix(d["text_ids"], d["prompt_text_ids"], d["prompt_speech_token"])
    slots = torch.tensor([slot])
    hs = [lm.forward_cached(prefix[None], cache, slots, torch.tensor([0]))[:, -1]]
    for i, tok in enumerate(d["target_speech_token"].reshape(-1).tolist()):
        emb = lm.embed_speech(torch.tensor([[tok]]))
        hs.append(lm.forward_cached(emb, cache, slots, torch.tensor([prefix.shape[0] + i]))[:, -1])
    return prefix, torch.cat(hs)


@pytest.mark.parity
@pytest.mark.parametrize("case", TEACHER_CASES)
@torch.inference_mode()
def test_teacher_forced_logprobs(lm, case):
    d = tensors(case)
    cache = KVCache.allocate(lm, n_slots=3, max_len=1024)
    prefix, hidden = _teacher_forced(lm, d, cache, slot=2)
    if "lm_input_prefix" in d:
        check_close(prefix, d["lm_input_prefix"][0], f"{case} lm_input_prefix")
    if "step_hidden" in d:
        check_close(hidden, d["step_hidden"], f"{case} step_hidden")
    logp = lm.logprobs(hidden)
    check_close(logp, d["logp"], f"{case} logp")
    # The KV-cached decode equals one full causal pass of transformers' own Qwen2Model (our two
    # paths, different summation order).
    full = torch.cat([prefix, lm.embed_speech(d["target_speech_token"].reshape(-1))])[None]
    ref_hidden = lm.forward_full(full)[0, prefix.shape[0] - 1:]
    assert rel_l2(hidden, ref_hidden) <= SELF_TOL


@pytest.mark.parity
@pytest.mark.parametrize("case", SEEDED_CASES)
def test_seeded_sampling_reproduces_upstream(lm, case):
    d, m = tensors(case), meta(case)
    g = torch.Generator().manual_seed(int(m["seed"]))
    out = list(lm.generate(d["text_ids"], d["prompt_text_ids"], d["prompt_speech_token"], generator=g))
    assert out == d["sampled_speech_token"].reshape(-1).tolist()


@pytest.mark.parity
@torch.inference_mode()
def test_slots_in_one_batch_match_single_runs(lm):
    """Requests at different positions in different slots share one decode step exactly."""
    if len(TEACHER_CASES) < 2:
        pytest.skip("needs two teacher-forced cases")
    cases = [tensors(c) for c in TEACHER_CASES[:3]]
    cache = KVCache.allocate(lm, n_slots=len(cases) + 1, max_len=1024)
    singles, lengths, slots = [], [], []
    for i, d in enumerate(cases):
        slot = i + 1  # leave slot 0 unused on purpose
        prefix = lm.embed_prefix(d["text_ids"], d["prompt_text_ids"], d["prompt_speech_token"])
        lm.forward_cached(prefix[None], cache, torch.tensor([slot]), torch.tensor([0]))
        lengths.append(prefix.shape[0])
        slots.append(slot)
        # single-request reference for the next 3 steps, in a private cache
        _, h = _teacher_forced(lm, {**d, "target_speech_token": d["target_speech_token"][..., :3]},
                               KVCache.allocate(lm, 1, 1024), 0)
        singles.append(h[1:])
    batched = []
    for step in range(3):
        toks = torch.tensor([[int(d["target_speech_token"].reshape(-1)[step])] for d in cases])
        start = torch.tensor(lengths) + step
        batched.append(lm.forward_cached(lm.embed_speech(toks), cache, torch.tensor(slots), start)[:, -1])
    batched = torch.stack(batched, dim=1)  # [B, 3, H]
    for i in range(len(cases)):
        assert rel_l2(batched[i], singles[i]) <= SELF_TOL


def test_llm_checkpoint_errors_name_the_key(tmp_path):
    md = open_model_dir(model_dir(), need=("llm",))
    cfg = load_config(md.yaml)
    sd = read_state_dict(md.llm)
    with torch.device("meta"):
        lm = SpeechLM(cfg.llm)
    broken = dict(sd)
    broken.pop("llm_decoder.bias")
    with pytest.raises(CheckpointError, match="llm_decoder.bias"):
        load_strict(lm, broken, "llm.pt", assign=True)
    broken = dict(sd)
    broken["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_strict(lm, broken, "llm.pt", assign=True)
    broken = dict(sd)
    broken["speech_embedding.weight"] = torch.zeros(5, 3)
    with pytest.raises(CheckpointError, match=r"speech_embedding.weight: checkpoint \(5, 3\)"):
        load_strict(lm, broken, "llm.pt", assign=True)


def test_full_size_llm_matches_manifest(tmp_path):
    cfg = full_size_config(tmp_path)
    with torch.device("meta"):
        lm = SpeechLM(cfg.llm)
    got = {k: list(v.shape) for k, v in lm.state_dict().items()}
    assert got == manifest_shapes("llm")
    unique = {id(p): p.numel() for p in lm.parameters()}
    assert sum(unique.values()) == manifest("llm")["n_parameters_unique_storage"]


def test_batched_sampling_equals_per_row_sampling():
    """UpstreamSampler.sample_batch draws exactly what per-row sample() draws (tokens and
    generator states), including ties across the top-k boundary, EOS masking and the
    repetition-aware resampling."""
    from cosyserve.models.config import SamplingConfig
    from cosyserve.models.sampling import UpstreamSampler

    s = UpstreamSampler(SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1), eos_id=6561)
    bsz, vocab = 16, 6564
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        logits = torch.randn(bsz, vocab, generator=gen) * [0.5, 2, 5, 10, 30][trial % 5]
        if trial % 3 == 0:  # many probabilities equal to the 25th largest: ties inside and across top-k
            logits[:, 100:140] = torch.topk(logits, 30, dim=1).values[:, 24:25]
        if trial % 4 == 0:  # peaked on token 5, which half the rows just repeated: RAS resampling
            logits[:, 5] = 50.0
        logp = logits.log_softmax(-1)
        decoded = [[5] * 10 if (trial % 4 == 0 and b % 2) else list(range(b, b + 10)) for b in range(bsz)]
        ignore = [(b + trial) % 3 == 0 for b in range(bsz)]
        g1 = [torch.Generator().manual_seed(1000 * trial + b) for b in range(bsz)]
        g2 = [torch.Generator().manual_seed(1000 * trial + b) for b in range(bsz)]
        one = [s.sample(logp[b], decoded[b], g1[b], ignore[b]) for b in range(bsz)]
        assert s.sample_batch(logp, decoded, g2, ignore) == one
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(g1, g2))
    with pytest.raises(ValueError):
        s.sample_batch(logp, decoded[:2], g2, ignore)


def test_device_sampling_follows_the_ras_rule():
    """ras_sample_device: nucleus frequencies match the nucleus probabilities, a token repeated
    in the window is replaced by a draw from the rest of the distribution, EOS is masked on
    request, and draws depend only on (seed, step), not on the batch."""
    import collections

    from cosyserve.models.config import SamplingConfig
    from cosyserve.models.sampling import counter_uniform, ras_sample_device

    cfg, v, eos = SamplingConfig(), 30, 29
    logp = (torch.randn(v, generator=torch.Generator().manual_seed(3)) * 2).log_softmax(0)
    n = 20000
    none = torch.full((n, cfg.win_size), -1)
    toks = ras_sample_device(logp.expand(n, v), none, torch.arange(n), torch.zeros(n, dtype=torch.long),
                             torch.zeros(n, dtype=torch.bool), cfg, eos)
    p, order = logp.softmax(0).sort(descending=True)
    keep = int(((p.cumsum(0) - p) < cfg.top_p).sum().clamp(max=cfg.top_k))
    nucleus = p[:keep] / p[:keep].sum()
    freq = collections.Counter(toks.tolist())
    assert set(freq) <= set(order[:keep].tolist())
    for i in range(keep):
        assert abs(freq[int(order[i])] / n - float(nucleus[i])) < 0.015
    # the top token, repeated in the window, is never the answer; the draw spans the rest
    top = int(order[0])
    rep = ras_sample_device(logp.expand(n, v), torch.full((n, cfg.win_size), top), torch.arange(n),
                            torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool), cfg, eos)
    assert top not in rep.tolist() and len(set(rep.tolist())) > keep
    # EOS masked
    peaked = torch.full((v,), -20.0)
    peaked[eos] = 0.0
    masked = ras_sample_device(peaked.log_softmax(0).expand(64, v), none[:64], torch.arange(64),
                               torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool), cfg, eos)
    assert eos not in masked.tolist()
    # batch independence: row 5 alone gives what it gives among others
    seeds, steps = torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([0, 3, 7, 1, 9, 4])
    logps = torch.randn(6, v, generator=torch.Generator().manual_seed(4)).log_softmax(1)
    together = ras_sample_device(logps, none[:6], seeds, steps, torch.zeros(6, dtype=torch.bool), cfg, eos)
    alone = ras_sample_device(logps[5:], none[:1], seeds[5:], steps[5:], torch.zeros(1, dtype=torch.bool), cfg, eos)
    assert int(together[5]) == int(alone[0])
    u = counter_uniform(torch.tensor([1, 1]), torch.tensor([0, 1]), 0, torch.arange(50000))
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert float((u[0] - u[1]).abs().mean()) > 0.3  # another step, other numbers


@torch.inference_mode()
def test_fused_projections_share_the_weights_and_follow_reloads(lm):
    """The decode path reads q/k/v and gate/up as single fused GEMMs; the original parameters
    are views of those tensors (no second copy), ``state_dict`` is unchanged, an in-place
    reload reaches the fused weights, and replacing a parameter rebuilds them."""
    layer = lm.backbone.layers[0]
    fused = lm._fused_layers()[0]
    a, m = layer.self_attn, layer.mlp
    assert a.q_proj.weight.data_ptr() == fused.qkv_w.data_ptr()
    assert a.v_proj.weight.data_ptr() == fused.qkv_w[-a.v_proj.weight.shape[0]:].data_ptr()
    assert m.up_proj.weight.data_ptr() == fused.gate_up_w[m.gate_proj.weight.shape[0]:].data_ptr()
    sd = {k: v.clone() for k, v in lm.state_dict().items()}
    prefix = torch.randn(1, 9, lm.cfg.llm_input_size)

    def run():
        cache = KVCache.allocate(lm, 1, 64)
        return lm.forward_cached(prefix, cache, torch.tensor([0]), torch.tensor([0]))

    before = run()
    try:
        with torch.no_grad():
            a.k_proj.weight.mul_(2.0)  # in place: the fused tensor sees it
        assert not torch.equal(run(), before)
        with torch.inference_mode(False), torch.no_grad():
            a.v_proj.weight = torch.nn.Parameter(a.v_proj.weight.detach().clone())  # replaced
        assert lm._fused_layers()[0].qkv_w.data_ptr() != fused.qkv_w.data_ptr()
    finally:
        with torch.inference_mode(False):
            lm.load_state_dict(sd)
    assert torch.equal(run(), before)
    assert set(lm.state_dict()) == set(sd)


@torch.inference_mode()
def test_slot_ordered_decode_equals_gathered_and_leaves_idle_slots(lm):
    """A decode step over a slice of slots (rows = slots, the cache read as views and written
    with a scatter; what the CUDA-graphed decoder runs) computes what the gathered path
    computes for the active rows; idle rows write only their slot's ``idle_pos`` and leave the
    slot's DecodeState unchanged."""
    from cosyserve.models.config import SamplingConfig
    from cosyserve.models.graphs import SlotRows
    from cosyserve.models.llm import DecodeState

    torch.manual_seed(0)
    cache = KVCache.allocate(lm, n_slots=5, max_len=96)
    lengths = {0: 9, 1: 30, 3: 17}  # slot 2 free, slot 1 busy but not decoding this step
    for slot, n in lengths.items():
        emb = lm.embed_speech(torch.randint(0, 6561, (1, n)))
        lm.forward_cached(emb, cache, torch.tensor([slot]), torch.tensor([0]))
    cfg = SamplingConfig()
    state = DecodeState.allocate(5, cfg.win_size)
    state.load([0, 1, 3], [torch.randint(0, 6561, (n,)).tolist() for n in (2, 14, 5)])
    ref_cache, ref_state = KVCache(cache.k.clone(), cache.v.clone()), DecodeState(state.last.clone(), state.recent.clone())

    rows = SlotRows([1, 2, 4], idle_pos=95)
    seed, step = torch.tensor([7, 8]), torch.tensor([3, 0])
    ignore = torch.tensor([True, False])
    bb, packed, kv_need = rows.pack(torch.tensor([3, 0]), torch.tensor([17, 9]), seed=seed, step=step, ignore_eos=ignore)
    assert bb == 4 and kv_need == 18
    f = lambda name: rows.field(packed, name)  # noqa: E731
    assert f("start").tolist() == [9, 95, 95, 17] and f("active").tolist() == [1, 0, 0, 1]
    assert f("seed").tolist() == [8, 0, 0, 7] and f("order")[:2].tolist() == [3, 0]
    logp, tok = lm.decode_sample(cache, state, slice(0, bb), f("start"), f("seed"), f("step"), f("ignore_eos") != 0,
                                 cfg, lm.cfg.eos_token, kv_len=32, active=f("active") != 0)
    ref_logp, ref_tok = lm.decode_sample(ref_cache, ref_state, torch.tensor([3, 0]), torch.tensor([17, 9]), seed, step,
                                         ignore, cfg, lm.cfg.eos_token, kv_len=32)
    order = f("order")[:2]
    assert rel_l2(logp[order], ref_logp) <= 1e-5 and torch.equal(tok[order], ref_tok)
    assert torch.equal(state.last, ref_state.last) and torch.equal(state.recent, ref_state.recent)
    for slot in (0, 3):  # the decoded slots: written identically
        assert rel_l2(cache.k[:, slot], ref_cache.k[:, slot]) <= 1e-6
    # idle slots 1 and 2: everything but position idle_pos untouched
    assert torch.equal(cache.k[:, 1:3, :, :95], ref_cache.k[:, 1:3, :, :95])
    assert torch.equal(cache.v[:, 1:3, :, :95], ref_cache.v[:, 1:3, :, :95])
    with pytest.raises(ValueError, match="distinct"):
        rows.pack(torch.tensor([1, 1]), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        rows.pack(torch.tensor([4]), torch.tensor([3]))
