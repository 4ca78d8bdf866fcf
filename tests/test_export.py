"""`cosyserve convert-llm`: the exported HF Qwen2ForCausalLM gives the native speech-token log-probs."""

from __future__ import annotations

import json

import pytest
import torch

from _reference import check_close, discover, model_dir, tensors
from cosyserve.models.export import BIAS_FILE, SpeechVocab, export_llm

CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token", "target_speech_token", "logp"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    sv = export_llm(model_dir(), out, dtype=torch.float32)
    return out, sv


def test_layout_and_tokenizer(exported):
    from transformers import AutoTokenizer

    out, sv = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["vocab_size"] % 128 == 0
    assert SpeechVocab.from_config(cfg) == sv
    assert sv.speech_token_offset == 151663  # = ORIGINAL_VOCAB_SIZE of CosyVoice's TensorRT-LLM runtime
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("<|s_0|>") == sv.speech_token_offset
    assert tok.convert_tokens_to_ids("<|s_6560|>") == sv.speech_token_offset + 6560
    assert tok.convert_tokens_to_ids("<|eos1|>") == sv.eos_token_id
    assert tok.convert_tokens_to_ids("<|sos|>") == sv.sos_token_id
    assert tok.convert_tokens_to_ids("<|task_id|>") == sv.task_id_token_id
    assert tok.encode("<|sos|>你好<|task_id|><|s_12|>")[0] == sv.sos_token_id
    assert tok.encode("<|sos|>你好<|task_id|><|s_12|>")[-1] == sv.speech_to_id(12)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
@torch.inference_mode()
def test_exported_logprobs_equal_native(exported, case):
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    out, sv = exported
    model = Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    bias = load_file(str(out / BIAS_FILE))["bias"]
    d = tensors(case)
    prefix = sv.prompt_ids(d["text_ids"].reshape(-1).tolist(), d["prompt_text_ids"].reshape(-1).tolist(),
                           d["prompt_speech_token"].reshape(-1).tolist())
    targets = [sv.speech_to_id(t) for t in d["target_speech_token"].reshape(-1).tolist()]
    ids = torch.tensor([prefix + targets])
    logits = model(input_ids=ids).logits[0, len(prefix) - 1:]
    lo, hi = sv.speech_token_offset, sv.speech_token_offset + bias.numel()
    logp = (logits[:, lo:hi] + bias).log_softmax(-1)
    check_close(logp, d["logp"], f"{case} exported logp")
