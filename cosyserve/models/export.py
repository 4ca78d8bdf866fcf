"""Export the speech LM as a standard Hugging Face ``Qwen2ForCausalLM`` checkpoint.

So that vLLM, SGLang, TensorRT-LLM (``trtllm-build`` / ``trtllm-serve``) or plain
``transformers`` can serve CosyVoice2's speech LM as an ordinary causal LM, the
CosyVoice heads are folded into one extended vocabulary, the way the ``cosyvoice2_llm``
checkpoint of CosyVoice's TensorRT-LLM runtime does (``ORIGINAL_VOCAB_SIZE = 151663``):

==============================  ============================================  ======================
token ids                       meaning                                       embedding row from
==============================  ============================================  ======================
``0 .. T-1``                    text tokens (BlankEN tokenizer incl. the      Qwen ``embed_tokens``
                                CosyVoice special tokens; ``T = 151663``)
``T + i``, ``0 <= i < S``       speech token ``i`` (``<|s_i|>``; S = 6561)    ``speech_embedding[i]``
``T + S``                       ``<|eos1|>`` end of speech (stop)             ``speech_embedding[S]``
``T + S + 1``                   ``<|eos2|>`` (stop)                           ``speech_embedding[S+1]``
``T + S + 2``                   ``<|fill|>`` (stop)                           ``speech_embedding[S+2]``
``T + S + 3``                   ``<|sos|>``                                   ``llm_embedding[0]``
``T + S + 4``                   ``<|task_id|>``                               ``llm_embedding[1]``
==============================  ============================================  ======================

The vocabulary is padded to a multiple of 128 with zero rows. ``lm_head`` (untied) has
``llm_decoder``'s rows at ``T .. T+S+2`` and zero rows elsewhere. A request's prompt is
``[<|sos|>] + text_ids(prompt_text + text) + [<|task_id|>] + [T + t for t in
prompt_speech_tokens]``, and a generated id ``x`` is speech token ``x - T``.

**The decoder bias.** Upstream's ``llm_decoder`` is ``Linear(H, S+3)`` *with* a bias;
Qwen2's ``lm_head`` has none, and because it follows an RMSNorm no weight
re-arrangement can reproduce a per-token constant. The bias is therefore written beside
the weights (``speech_logit_bias.safetensors``: ``bias`` ``[S+3]`` float32, to be added
to the logits of ids ``T .. T+S+2``) and described in ``config.json`` under
``"cosyserve"``. With the bias added, the exported model's log-probabilities over the
speech ids equal the native speech LM's (tested on the reference cases); servers apply
it as a per-request ``logit_bias`` (OpenAI completions API) or natively (``cosyserve
serve --llm-only``). Text ids get logit 0 from the zero rows; normalising over the speech
ids (or restricting sampling to them) removes them exactly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .llm import SpeechLM

BIAS_FILE = "speech_logit_bias.safetensors"
VOCAB_ALIGN = 128


@dataclass(frozen=True)
class SpeechVocab:
    """Where the speech LM's ids live in the exported vocabulary (see module docstring)."""

    speech_token_offset: int
    speech_token_size: int
    vocab_size: int

    @property
    def eos_token_id(self) -> int:
        return self.speech_token_offset + self.speech_token_size

    @property
    def stop_token_ids(self) -> tuple[int, int, int]:
        e = self.eos_token_id
        return (e, e + 1, e + 2)

    @property
    def sos_token_id(self) -> int:
        return self.eos_token_id + 3

    @property
    def task_id_token_id(self) -> int:
        return self.eos_token_id + 4

    def speech_to_id(self, token: int) -> int:
        return self.speech_token_offset + int(token)

    def id_to_speech(self, token_id: int) -> int | None:
        """Speech token of an exported id, or ``None`` if it is not a speech token."""
        t = int(token_id) - self.speech_token_offset
        return t if 0 <= t < self.speech_token_size else None

    def prompt_ids(self, text_ids, prompt_text_ids, prompt_speech_tokens) -> list[int]:
        """Token ids of a request's prefix in the exported vocabulary."""
        ids = [self.sos_token_id]
        ids += [int(t) for t in list(prompt_text_ids) + list(text_ids)]
        ids.append(self.task_id_token_id)
        ids += [self.speech_to_id(t) for t in prompt_speech_tokens]
        return ids

    @classmethod
    def from_config(cls, config: dict) -> "SpeechVocab":
        c = config["cosyserve"]
        return cls(int(c["speech_token_offset"]), int(c["speech_token_size"]), int(config["vocab_size"]))


def added_token_names(speech_token_size: int) -> list[str]:
    """Names of the tokens appended after the text vocabulary, in id order."""
    return [f"<|s_{i}|>" for i in range(speech_token_size)] + [
        "<|eos1|>", "<|eos2|>", "<|fill|>", "<|sos|>", "<|task_id|>"
    ]


def build_export(lm: SpeechLM, text_vocab_size: int, dtype: torch.dtype = torch.bfloat16):
    """Build the exported weights.

    Args:
      lm: the native speech LM (any device/dtype).
      text_vocab_size: ``T``, the size of the text tokenizer with CosyVoice's special
        tokens (151663 for the official BlankEN folder); must not exceed the Qwen
        embedding rows.
      dtype: dtype of the written weights.
    Returns ``(state_dict, config_dict, bias [S+3] float32, SpeechVocab)`` where the state
    dict uses the standard HF ``Qwen2ForCausalLM`` key names.
    """
    cfg = lm.cfg
    s = cfg.speech_token_size
    emb_rows = lm.backbone.embed_tokens.weight.shape[0]
    if not 0 < text_vocab_size <= emb_rows:
        raise ValueError(f"text vocabulary size {text_vocab_size} must be in 1..{emb_rows}")
    n_new = cfg.num_speech_rows + 2
    vocab = -(-(text_vocab_size + n_new) // VOCAB_ALIGN) * VOCAB_ALIGN
    sv = SpeechVocab(text_vocab_size, s, vocab)
    h = lm.cfg.llm_input_size

    def cpu(t):
        return t.detach().to("cpu", torch.float32, copy=True)  # own storage: the LM fuses projections into shared tensors

    embed = torch.zeros(vocab, h)
    embed[:text_vocab_size] = cpu(lm.backbone.embed_tokens.weight[:text_vocab_size])
    embed[sv.speech_token_offset : sv.speech_token_offset + cfg.num_speech_rows] = cpu(lm.speech_embedding.weight)
    embed[sv.sos_token_id] = cpu(lm.llm_embedding.weight[lm.sos_id])
    embed[sv.task_id_token_id] = cpu(lm.llm_embedding.weight[lm.task_id])
    head = torch.zeros(vocab, h)
    head[sv.speech_token_offset : sv.speech_token_offset + cfg.num_speech_rows] = cpu(lm.llm_decoder.weight)
    bias = cpu(lm.llm_decoder.bias) if lm.llm_decoder.bias is not None else torch.zeros(cfg.num_speech_rows)

    sd: dict[str, torch.Tensor] = {}
    skip = ("embed_tokens.", "rotary_emb.")
    for k, v in lm.backbone.state_dict().items():
        if not k.startswith(skip):
            sd[f"model.{k}"] = cpu(v).to(dtype).contiguous()
    sd["model.embed_tokens.weight"] = embed.to(dtype)
    sd["lm_head.weight"] = head.to(dtype)

    config = {k: v for k, v in cfg.qwen.items() if k not in ("torch_dtype", "dtype")}
    config.update(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=vocab,
        tie_word_embeddings=False,
        bos_token_id=sv.sos_token_id,
        eos_token_id=list(sv.stop_token_ids),
        pad_token_id=sv.eos_token_id,
        torch_dtype=str(dtype).replace("torch.", ""),
        cosyserve={
            "format": "cosyvoice2-speech-lm",
            "speech_token_offset": sv.speech_token_offset,
            "speech_token_size": s,
            "sos_token_id": sv.sos_token_id,
            "task_id_token_id": sv.task_id_token_id,
            "stop_token_ids": list(sv.stop_token_ids),
            "speech_logit_bias_file": BIAS_FILE,
            "sampling": asdict(cfg.sampling),
            "prompt": "[<|sos|>] + text(prompt_text + text) + [<|task_id|>] + [offset + prompt speech tokens]",
        },
    )
    return sd, config, bias, sv


def export_llm(model_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> SpeechVocab:
    """``cosyserve convert-llm``: write the HF checkpoint of ``model_dir``'s speech LM.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors``,
    ``speech_logit_bias.safetensors`` and the tokenizer files (text vocabulary plus the
    appended tokens of :func:`added_token_names`) into ``out_dir``. Raises
    :class:`~cosyserve.errors.ModelDirError` for an unusable model directory.
    """
    from safetensors.torch import save_file

    from ..frontend.tokenizer import TextTokenizer
    from .loader import load_llm, open_model_dir
    from .config import load_config

    md = open_model_dir(model_dir, need=("llm", "qwen"))
    cfg = load_config(md.yaml)
    lm = load_llm(md, cfg)
    tok = TextTokenizer(md.qwen)
    text_vocab = len(tok)
    sd, config, bias, sv = build_export(lm, text_vocab, dtype)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({"bias": bias.contiguous()}, str(out / BIAS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    gen = {"bos_token_id": sv.sos_token_id, "eos_token_id": list(sv.stop_token_ids), "pad_token_id": sv.eos_token_id,
           "do_sample": True, "top_k": cfg.llm.sampling.top_k, "top_p": cfg.llm.sampling.top_p}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    hf_tok = tok.hf_tokenizer
    names = added_token_names(cfg.llm.speech_token_size)
    hf_tok.add_tokens(names, special_tokens=True)
    first = hf_tok.convert_tokens_to_ids(names[0])
    last = hf_tok.convert_tokens_to_ids(names[-1])
    if first != sv.speech_token_offset or last != sv.task_id_token_id:
        raise RuntimeError(f"tokenizer ids of the appended tokens ({first}..{last}) do not match the export layout")
    hf_tok.chat_template = (
        "{%- for message in messages %}{%- if message['role'] == 'user' %}"
        "{{- '<|sos|>' + message['content'] + '<|task_id|>' }}"
        "{%- elif message['role'] == 'assistant' %}{{- message['content'] }}{%- endif %}{%- endfor %}"
    )
    hf_tok.save_pretrained(str(out))
    return sv
