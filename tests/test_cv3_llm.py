"""CosyVoice3 speech LM (upstream ``CosyVoice3LM``): config layout, strict loading, parity.

Cases come from the CosyVoice3 reference set (:mod:`_reference_cv3`), discovered by kind and
tensors; the full-size module is checked against ``manifests/llm_state_dict.json``.
"""

from __future__ import annotations

import pytest
import torch

from _reference_cv3 import (
    discover,
    full_size_config,
    manifest,
    manifest_shapes,
    meta,
    model_dir,
    rel_l2,
    tensors,
)
from cosyserve.errors import CheckpointError, ConfigError
from cosyserve.models.checkpoint import load_strict, read_state_dict
from cosyserve.models.config import load_config, load_hyperpyyaml, parse_config
from cosyserve.models.llm import KVCache, SilentTokenFilter, SpeechLM
from cosyserve.models.loader import load_llm, open_model_dir
from cosyserve.models.sampling import UpstreamSampler

TEACHER_CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token", "target_speech_token", "logp"))
SEEDED_CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token", "speech_token"),
                        where=lambda m: "seed" in m)
E2E_CASES = discover("e2e", has=("llm_tokens", "speech_token"), where=lambda m: "silent_tokens" in m)


@pytest.fixture(scope="module")
def md():
    return open_model_dir(model_dir(), need=("llm",))


@pytest.fixture(scope="module")
def cfg(md):
    return load_config(md.yaml)


@pytest.fixture(scope="module")
def lm(md, cfg):
    return load_llm(md, cfg)


# ----------------------------------------------------------------------------- config


def test_model_dir_is_recognised_as_cosyvoice3(md, cfg):
    assert md.family == "cosyvoice3" and md.yaml.name == "cosyvoice3.yaml"
    assert md.speech_tokenizer.name == "speech_tokenizer_v3.onnx"
    assert cfg.model_family == "cosyvoice3" and cfg.llm.lm_class == "CosyVoice3LM"
    assert cfg.feat.fmax is None  # CosyVoice3's prompt mel: fmax null (sr / 2)


@pytest.mark.parametrize("case", TEACHER_CASES[:1])
def test_token_layout_follows_the_sidecar_constants(cfg, case):
    c = meta(case).get("constants")
    if not c:
        pytest.skip("sidecar has no constants")
    llm = cfg.llm
    assert llm.speech_token_size == c["speech_token_size"]
    assert llm.sos_token == c["sos"] and llm.eos_token == c["eos_token"]
    assert llm.task_id_token == c["task_id"] and llm.fill_token == c["fill_token"]
    assert llm.num_speech_rows == c["llm_decoder_out_dim"] == c["speech_embedding_rows"]
    assert llm.decoder_bias == c["llm_decoder_bias"]
    assert llm.has_llm_embedding == (not c["no_llm_embedding_module"])
    assert llm.stop_token_ids == tuple(range(llm.speech_token_size, llm.num_speech_rows))
    assert llm.min_len_mask_id == c["sos"]  # upstream masks index speech_token_size: the sos id


def test_cosyvoice2_layout_unchanged(tmp_path):
    """The CosyVoice2 rules still hold (eos = S, three stop ids, llm_embedding, biased decoder)."""
    from _reference import model_dir as cv2_model_dir

    p = cv2_model_dir() / "cosyvoice2.yaml"
    if not p.is_file():
        pytest.skip("no CosyVoice2 reference model")
    llm = load_config(p).llm
    s = llm.speech_token_size
    assert (llm.eos_token, llm.fill_token, llm.min_len_mask_id) == (s, s + 2, s)
    assert llm.stop_token_ids == (s, s + 1, s + 2) and llm.num_speech_rows == s + 3
    assert llm.has_llm_embedding and llm.decoder_bias and llm.sos_token is None and not llm.silent_tokens


def test_family_classes_do_not_mix(md, tmp_path):
    text = md.yaml.read_text(encoding="utf-8")
    # a CosyVoice3 yaml under the CosyVoice2 name
    (tmp_path / "cosyvoice2.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="cosyvoice2.yaml must describe a CosyVoice2 model"):
        load_config(tmp_path / "cosyvoice2.yaml")
    # a CosyVoice2 flow class inside a CosyVoice3 yaml
    bad = text.replace("cosyvoice.flow.flow.CausalMaskedDiffWithDiT", "cosyvoice.flow.flow.CausalMaskedDiffWithXvec")
    (tmp_path / "cosyvoice3.yaml").write_text(bad, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"flow.*CausalMaskedDiffWithDiT \(CosyVoice3\)"):
        load_config(tmp_path / "cosyvoice3.yaml")
    # an unknown LM class
    data = load_hyperpyyaml(md.yaml)
    data["llm"].target = "cosyvoice.llm.llm.TransformerLM"
    with pytest.raises(ConfigError, match="TransformerLM.*CosyVoice3LM"):
        parse_config(data)


def test_open_model_dir_errors(tmp_path):
    from cosyserve.errors import ModelDirError

    with pytest.raises(ModelDirError, match="missing cosyvoice2.yaml or cosyvoice3.yaml, llm.pt"):
        open_model_dir(tmp_path)
    (tmp_path / "cosyvoice3.yaml").write_text("a: 1\n")
    with pytest.raises(ModelDirError, match="complete CosyVoice3 model directory: missing .*speech_tokenizer_v3.onnx"):
        open_model_dir(tmp_path)
    (tmp_path / "cosyvoice2.yaml").write_text("a: 1\n")
    with pytest.raises(ModelDirError, match="both"):
        open_model_dir(tmp_path)


# ----------------------------------------------------------------------------- weights


def test_llm_pt_loads_strictly_and_has_no_llm_embedding(md, cfg, lm):
    sd = read_state_dict(md.llm)
    assert not any(k.startswith("llm_embedding.") for k in sd)
    assert set(lm.state_dict()) == set(sd)
    assert lm.llm_decoder.bias is None
    with torch.device("meta"):
        fresh = SpeechLM(cfg.llm)
    broken = dict(sd)
    broken["llm_embedding.weight"] = torch.zeros(2, cfg.llm.llm_input_size)
    with pytest.raises(CheckpointError, match="llm_embedding.weight"):
        load_strict(fresh, broken, "llm.pt", assign=True)
    broken = dict(sd)
    broken["llm_decoder.bias"] = torch.zeros(cfg.llm.num_speech_rows)
    with pytest.raises(CheckpointError, match="llm_decoder.bias"):
        load_strict(fresh, broken, "llm.pt", assign=True)


def test_full_size_llm_matches_manifest(tmp_path):
    cfg = full_size_config(tmp_path)
    assert cfg.model_family == "cosyvoice3"
    with torch.device("meta"):
        lm = SpeechLM(cfg.llm)
    got = {k: list(v.shape) for k, v in lm.state_dict().items()}
    assert got == manifest_shapes("llm")
    # parameters once per storage = the manifest's tensors, each shared group counted once (the
    # sidecar's "n_parameters_unique_storage" also counts 32 non-checkpoint numbers, the size of
    # the rotary inv_freq buffer, so it is not compared)
    man = manifest("llm")
    dup = {k for group in man.get("shared_storage_keys", []) for k in sorted(group)[1:]}
    expected = sum(torch.Size(e["shape"]).numel() for e in man["tensors"] if e["key"] not in dup)
    unique = {id(p): p.numel() for p in lm.parameters()}
    assert sum(unique.values()) == expected


# ----------------------------------------------------------------------------- parity


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
    d, m = tensors(case), meta(case)
    cache = KVCache.allocate(lm, n_slots=3, max_len=1024)
    prefix, hidden = _teacher_forced(lm, d, cache, slot=1)
    if "lm_input_prefix" in d:
        assert rel_l2(prefix, d["lm_input_prefix"][0]) <= 1e-6
    if "step_hidden" in d:
        assert rel_l2(hidden, d["step_hidden"]) <= 1e-4
    logp = lm.logprobs(hidden)
    assert logp.shape == d["logp"].shape
    assert rel_l2(logp, d["logp"]) <= 1e-4
    full = torch.cat([prefix, lm.embed_speech(d["target_speech_token"].reshape(-1))])[None]
    ref_hidden = lm.forward_full(full)[0, prefix.shape[0] - 1:]
    assert rel_l2(hidden, ref_hidden) <= 1e-5
    if "ignore_eos" in d:
        # min_len counts the tts text only; the masked id is cfg.min_len_mask_id
        min_len = int(d["text_ids"].numel() * 2)
        if "min_len" in m:
            assert m["min_len"] == min_len
        steps = torch.arange(d["ignore_eos"].numel())
        assert d["ignore_eos"].bool().tolist() == (steps < min_len).tolist()


@pytest.mark.parity
@pytest.mark.parametrize("case", TEACHER_CASES)
def test_min_len_mask_hits_the_sos_id(lm, case):
    """With ``ignore_eos`` the sampler masks id S (CosyVoice3's sos), never eos."""
    d = tensors(case)
    s = UpstreamSampler(lm.cfg.sampling, eos_id=lm.cfg.min_len_mask_id)
    logp = d["logp"][0].clone()
    logp[:] = -1e4
    logp[lm.cfg.min_len_mask_id] = 0.0  # all mass on the masked id ...
    logp[lm.cfg.eos_token] = -1.0       # ... then eos
    g = torch.Generator().manual_seed(0)
    assert s.sample(logp, [], g, ignore_eos=True) == lm.cfg.eos_token
    assert s.sample(logp, [], g, ignore_eos=False) == lm.cfg.min_len_mask_id


@pytest.mark.parity
@pytest.mark.parametrize("case", SEEDED_CASES)
def test_seeded_sampling_reproduces_upstream(lm, case):
    d, m = tensors(case), meta(case)
    g = torch.Generator().manual_seed(int(m["seed"]))
    out = list(lm.generate(d["text_ids"], d["prompt_text_ids"], d["prompt_speech_token"], generator=g))
    assert out == d["speech_token"].reshape(-1).tolist()


@pytest.mark.parity
@pytest.mark.parametrize("case", E2E_CASES)
def test_e2e_llm_tokens_and_silent_token_rule(lm, cfg, case):
    """The e2e case's LM tokens (seeded) and the llm_job silent-token filter's output."""
    d, m = tensors(case), meta(case)
    assert tuple(m["silent_tokens"]) == cfg.llm.silent_tokens
    if all(k in d for k in ("text_ids", "prompt_text_ids", "llm_prompt_speech_token")):
        g = torch.Generator().manual_seed(int(m["seed"]))
        out = list(lm.generate(d["text_ids"], d["prompt_text_ids"], d["llm_prompt_speech_token"], generator=g))
        assert out == d["llm_tokens"].reshape(-1).tolist()
    kept = SilentTokenFilter.for_config(cfg.llm).filter(d["llm_tokens"].reshape(-1).tolist())
    assert kept == d["speech_token"].reshape(-1).tolist()


def test_silent_token_filter_rule(cfg):
    silent = cfg.llm.silent_tokens
    if not silent:
        pytest.skip("no silent tokens")
    a, b = silent[0], silent[1]
    other = next(t for t in range(cfg.llm.speech_token_size) if t not in silent)
    n = cfg.llm.max_silent_tokens
    f = SilentTokenFilter.for_config(cfg.llm)
    seq = [a] * n + [b, a] + [other] + [b] * (n + 1)
    assert f.filter(seq) == [a] * n + [other] + [b] * n
    assert SilentTokenFilter((), n).filter(seq) == seq


@pytest.mark.parity
@torch.inference_mode()
def test_slots_in_one_batch_match_single_runs(lm):
    """CosyVoice3 requests at different positions in different slots share one decode step."""
    if len(TEACHER_CASES) < 2:
        pytest.skip("needs two teacher-forced cases")
    cases = [tensors(c) for c in TEACHER_CASES[:3]]
    cache = KVCache.allocate(lm, n_slots=len(cases) + 1, max_len=1024)
    singles, lengths, slots = [], [], []
    for i, d in enumerate(cases):
        slot = i + 1
        prefix = lm.embed_prefix(d["text_ids"], d["prompt_text_ids"], d["prompt_speech_token"])
        lm.forward_cached(prefix[None], cache, torch.tensor([slot]), torch.tensor([0]))
        lengths.append(prefix.shape[0])
        slots.append(slot)
        _, h = _teacher_forced(lm, {**d, "target_speech_token": d["target_speech_token"][..., :3]},
                               KVCache.allocate(lm, 1, 1024), 0)
        singles.append(h[1:])
    batched = []
    for step in range(3):
        toks = torch.tensor([[int(d["target_speech_token"].reshape(-1)[step])] for d in cases])
        start = torch.tensor(lengths) + step
        batched.append(lm.forward_cached(lm.embed_speech(toks), cache, torch.tensor(slots), start)[:, -1])
    batched = torch.stack(batched, dim=1)
    for i in range(len(cases)):
        assert rel_l2(batched[i], singles[i]) <= 1e-5


# ----------------------------------------------------------------------------- convert-llm


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from cosyserve.models.export import export_llm

    out = tmp_path_factory.mktemp("hf_cv3")
    sv = export_llm(model_dir(), out, dtype=torch.float32)
    return out, sv


def test_export_layout_and_tokenizer(exported, cfg):
    import json

    from transformers import AutoTokenizer

    from cosyserve.models.export import SpeechVocab

    out, sv = exported
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["Qwen2ForCausalLM"] and conf["vocab_size"] % 128 == 0
    assert SpeechVocab.from_config(conf) == sv and sv.family == "cosyvoice3"
    s = cfg.llm.speech_token_size
    tok = AutoTokenizer.from_pretrained(str(out))
    assert sv.speech_token_offset == len(tok) - cfg.llm.num_speech_rows  # text vocab incl. CV3 tokens
    assert tok.convert_tokens_to_ids(f"<|s_{s - 1}|>") == sv.speech_to_id(s - 1)
    assert tok.convert_tokens_to_ids("<|sos|>") == sv.sos_token_id == sv.speech_to_id(cfg.llm.sos_token)
    assert tok.convert_tokens_to_ids("<|eos1|>") == sv.eos_token_id == sv.speech_to_id(cfg.llm.eos_token)
    assert tok.convert_tokens_to_ids("<|task_id|>") == sv.task_id_token_id == sv.speech_to_id(cfg.llm.task_id_token)
    assert tok.convert_tokens_to_ids("<|fill|>") == sv.speech_to_id(cfg.llm.fill_token)
    last = cfg.llm.num_speech_rows - 1
    assert tok.convert_tokens_to_ids(f"<|s_{last}|>") == sv.speech_to_id(last)
    assert conf["eos_token_id"] == [sv.speech_to_id(t) for t in cfg.llm.stop_token_ids]
    assert conf["cosyserve"]["min_len_mask_token_id"] == sv.speech_to_id(cfg.llm.min_len_mask_id)
    ids = tok.encode("<|sos|>你好<|endofprompt|><|task_id|><|s_12|>")
    assert ids[0] == sv.sos_token_id and ids[-1] == sv.speech_to_id(12) and ids[-2] == sv.task_id_token_id


@pytest.mark.parity
@pytest.mark.parametrize("case", TEACHER_CASES)
@torch.inference_mode()
def test_exported_logprobs_equal_native(exported, case):
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    from cosyserve.models.export import BIAS_FILE

    out, sv = exported
    model = Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    bias = load_file(str(out / BIAS_FILE))["bias"]
    assert bias.numel() == sv.num_logit_rows and not bias.any()  # CosyVoice3's decoder has no bias
    d = tensors(case)
    prefix = sv.prompt_ids(d["text_ids"].reshape(-1).tolist(), d["prompt_text_ids"].reshape(-1).tolist(),
                           d["prompt_speech_token"].reshape(-1).tolist())
    targets = [sv.speech_to_id(t) for t in d["target_speech_token"].reshape(-1).tolist()]
    logits = model(input_ids=torch.tensor([prefix + targets])).logits[0, len(prefix) - 1:]
    lo = sv.speech_token_offset
    logp = (logits[:, lo:lo + bias.numel()] + bias).log_softmax(-1)
    assert rel_l2(logp, d["logp"]) <= 1e-4


# ----------------------------------------------------------------------------- engine (LM only)


@pytest.mark.parity
def test_engine_lm_only_requests_reproduce_upstream_tokens(md, cfg):
    """The engine's LM path (KV slots, batched prefill/decode, batched host sampling with the
    min_len mask on cfg.min_len_mask_id, CV3 stop ids) reproduces upstream's seeded tokens for
    several CosyVoice3 requests decoded concurrently. LM-only requests never run token2wav, so
    flow/HiFT are inert placeholders here (the CV3 token2wav half is tested elsewhere)."""
    from cosyserve.engine.core import EngineConfig, EngineCore
    from cosyserve.engine.request import EngineRequest, RequestFinished, SynthesisParams
    from cosyserve.frontend.voice import Voice
    from cosyserve.models.loader import CosyVoice2Models

    cases = [(c, "speech_token") for c in SEEDED_CASES] + [(c, "llm_tokens") for c in E2E_CASES]
    if not cases:
        pytest.skip("no seeded cases")
    models = CosyVoice2Models(cfg, load_llm(md, cfg), torch.nn.Identity(), torch.nn.Identity())
    core = EngineCore(models, EngineConfig(max_active=4, cuda_graphs=False))
    expected = {}
    for c, key in cases:
        d, m = tensors(c), meta(c)
        pst = (d["prompt_speech_token"] if "prompt_speech_token" in d else d["llm_prompt_speech_token"]).reshape(-1)
        v = Voice(c, "", d["prompt_text_ids"].reshape(-1), pst, pst, torch.zeros(2 * max(1, pst.numel()), 80),
                  torch.zeros(192), torch.zeros(192))
        core.add_request(EngineRequest(c, [d["text_ids"].reshape(-1).long()], v,
                                       SynthesisParams(seed=int(m["seed"]), lm_only=True, stream=False)))
        expected[c] = d[key].reshape(-1).tolist()
    events = []
    while core.has_work():
        events += core.step()
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    for c, toks in expected.items():
        assert done[c].error is None
        assert done[c].tokens[0] == toks, c


@pytest.mark.gpu
def test_engine_cv3_lm_on_cuda_graphs_and_device_sampling(md, cfg):
    """On CUDA the CV3 LM runs through the graphed decoder / prefill with device sampling and the
    pipelined decode: tokens are speech tokens, segments stop on a CV3 stop id or the length bound,
    and the max_len bound holds (min_len masks only the sos id, as upstream), with device sampling
    and with host sampling."""
    from cosyserve.engine.core import EngineConfig, EngineCore
    from cosyserve.engine.request import EngineRequest, RequestFinished, SynthesisParams
    from cosyserve.frontend.voice import Voice
    from cosyserve.models.loader import load_models

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cases = TEACHER_CASES + SEEDED_CASES
    models = load_models(md.root, device="cuda")  # the real tiny flow / HiFT: the engine sets up their graphs
    for device_sampling in (True, False):
        core = EngineCore(models, EngineConfig(max_active=4, device_sampling=device_sampling))
        bounds = {}
        for i, c in enumerate(cases):
            d = tensors(c)
            pst = d["prompt_speech_token"].reshape(-1)
            v = Voice(c, "", d["prompt_text_ids"].reshape(-1), pst, pst, torch.zeros(2 * max(1, pst.numel()), 80),
                      torch.zeros(192), torch.zeros(192))
            p = SynthesisParams(seed=i, lm_only=True, stream=False, min_token_text_ratio=1, max_token_text_ratio=3)
            core.add_request(EngineRequest(c, [d["text_ids"].reshape(-1).long()], v, p))
            bounds[c] = p.token_bounds(int(d["text_ids"].numel()))
        events = []
        while core.has_work():
            events += core.step()
        done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
        for c, (lo, hi) in bounds.items():
            toks, reason = done[c].tokens[0], done[c].stop_reasons[0]
            assert done[c].error is None and all(0 <= t < cfg.llm.speech_token_size for t in toks)
            # upstream's CV3 min_len mask covers only id 6561 (the sos id), so another stop id
            # (6562..6760) may end a segment before min_len: only the upper bound is guaranteed
            assert len(toks) <= hi and reason in ("stop", "length")
            assert (reason == "length") == (len(toks) == hi)
            assert len(toks) >= lo or reason == "stop"
        core.close()


# ----------------------------------------------------------------------------- demo / random weights


def _structure(node):
    """Class names and keys of a parsed yaml node (values dropped)."""
    from cosyserve.models.config import Tagged

    if isinstance(node, Tagged):
        return (node.target, _structure(node.args))
    if isinstance(node, dict):
        return {k: _structure(v) for k, v in node.items()}
    return None


def test_demo_cv3_yaml_has_the_official_model_sections(md, tmp_path):
    from cosyserve.models.demo import DemoSize, demo_yaml

    size = DemoSize()
    p = tmp_path / "cosyvoice3.yaml"
    p.write_text(demo_yaml(size, family="cosyvoice3"), encoding="utf-8")
    demo, ref = load_hyperpyyaml(p), load_hyperpyyaml(md.yaml)
    for key in ("llm", "flow", "hift", "feat_extractor", "get_tokenizer"):
        assert _structure(demo[key]) == _structure(ref[key]), key
    cfg = load_config(p)
    assert cfg.model_family == "cosyvoice3" and cfg.llm.llm_input_size == size.llm_hidden
    with pytest.raises(ValueError, match="unknown model family"):
        demo_yaml(size, family="cosyvoice9")


def test_demo_model_cosyvoice3(tmp_path):
    from cosyserve.errors import ModelDirError
    from cosyserve.models.demo import write_demo_model
    from cosyserve.models.loader import load_models

    try:
        out = write_demo_model(tmp_path / "demo3", family="cosyvoice3")
    except ModelDirError as exc:  # this build lacks the CosyVoice3 flow / HiFT half
        assert "CosyVoice3" in str(exc)
        pytest.skip(str(exc))
    md = open_model_dir(out)
    assert md.family == "cosyvoice3" and md.speech_tokenizer.is_file()
    m = load_models(out)
    assert m.cfg.model_family == "cosyvoice3" and m.llm.cfg.is_cosyvoice3


def test_random_weights_dir_for_the_real_cv3_yaml(tmp_path):
    from _reference_cv3 import require_cv3_dir

    from cosyserve.frontend.frontend import Frontend
    from cosyserve.models.demo import is_random_weights_dir, prepare_random_weights_dir

    man = require_cv3_dir() / "manifests"
    if not (man / "cosyvoice3.real.yaml").is_file() or not (man / "CosyVoice-BlankEN_config.real.json").is_file():
        pytest.skip("no full-size CosyVoice3 config")
    out = prepare_random_weights_dir(man / "cosyvoice3.real.yaml", man / "CosyVoice-BlankEN_config.real.json",
                                     tmp_path / "cache")
    assert is_random_weights_dir(out)
    md = open_model_dir(out)  # no weight files needed
    assert md.family == "cosyvoice3" and md.yaml.name == "cosyvoice3.yaml"
    fe = Frontend(md, normalizer="none")
    assert fe.cfg.llm.qwen["hidden_size"] == fe.cfg.llm.llm_input_size
    assert fe.tokenizer.version == "cosyvoice3" and len(fe.tokenizer) == fe.tokenizer.token_id("[ǜ]") + 1


def test_remote_lm_vocab_matches_the_export(cfg, exported):
    """The clients' idea of the exported layout (served /v1/completions, cosyserve batch) equals what
    convert-llm writes, and a CV3 extra id (any <|s_N|>, N >= S) ends the parsed output."""
    from cosyserve.client.remote_lm import parse_speech_tokens, speech_vocab

    _, sv = exported
    assert speech_vocab(sv.speech_token_offset, cfg.llm.speech_token_size, cfg.model_family) == sv
    s = cfg.llm.speech_token_size
    toks, ignored = parse_speech_tokens(f"<|s_3|><|s_{s - 1}|><|s_{s + 150}|><|s_4|>", None, sv)
    assert toks == [3, s - 1] and ignored == 0
    toks, _ = parse_speech_tokens(None, [sv.speech_to_id(5), sv.speech_to_id(s + 150), sv.speech_to_id(6)], sv)
    assert toks == [5]
