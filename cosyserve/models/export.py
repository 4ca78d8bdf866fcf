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

**CosyVoice3** (``CosyVoice3LM``) keeps sos / eos / task id / fill inside ``speech_embedding``
(rows ``S .. S+199``), so its export appends exactly those rows after ``T = 151924`` (the
CosyVoice3 tokenizer), as CosyVoice's CosyVoice3 TensorRT-LLM conversion does: ``T + i``
is ``speech_embedding[i]`` for ``0 <= i < S + 200``, named ``<|s_i|>`` except ``<|sos|>``
(``T+S``), ``<|eos1|>`` (``T+S+1``), ``<|task_id|>`` (``T+S+2``) and ``<|fill|>``
(``T+S+3``); every one of the 200 extra ids stops decoding, ``lm_head`` rows ``T .. T+S+199``
are ``llm_decoder``'s, and the decoder has no bias (the bias file holds zeros). The prompt
layout is the same.

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

from .config import LLMConfig
from .llm import SpeechLM

BIAS_FILE = "speech_logit_bias.safetensors"
VOCAB_ALIGN = 128


@dataclass(frozen=True)
class SpeechVocab:
    """Where the speech LM's ids live in the exported vocabulary (see module docstring).

    ``family``: ``"cosyvoice2"`` (``S + 5`` appended ids) or ``"cosyvoice3"`` (``S + 200``).
    """

    speech_token_offset: int
    speech_token_size: int
    vocab_size: int
    family: str = "cosyvoice2"

    @property
    def is_cosyvoice3(self) -> bool:
        return self.family == "cosyvoice3"

    @property
    def num_appended(self) -> int:
        """Ids appended after the text vocabulary."""
        return self.speech_token_size + (200 if self.is_cosyvoice3 else 5)

    @property
    def eos_token_id(self) -> int:
        return self.speech_token_offset + self.speech_token_size + (1 if self.is_cosyvoice3 else 0)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        first = self.speech_token_offset + self.speech_token_size
        return tuple(range(first, first + (200 if self.is_cosyvoice3 else 3)))

    @property
    def sos_token_id(self) -> int:
        return self.speech_token_offset + self.speech_token_size + (0 if self.is_cosyvoice3 else 3)

    @property
    def task_id_token_id(self) -> int:
        return self.speech_token_offset + self.speech_token_size + (2 if self.is_cosyvoice3 else 4)

    @property
    def min_len_mask_token_id(self) -> int:
        """The id upstream masks during the first ``min_len`` steps (native id ``S``)."""
        return self.speech_token_offset + self.speech_token_size

    @property
    def num_logit_rows(self) -> int:
        """``llm_decoder`` outputs (the bias length): ``S + 3`` or ``S + 200``."""
        return self.speech_token_size + (200 if self.is_cosyvoice3 else 3)

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
    def for_model(cls, llm: LLMConfig, text_vocab_size: int) -> "SpeechVocab":
        """The layout ``convert-llm`` writes for a model with this LM config and text tokenizer size."""
        family = "cosyvoice3" if llm.is_cosyvoice3 else "cosyvoice2"
        n = llm.speech_token_size + (200 if family == "cosyvoice3" else 5)
        vocab = -(-(text_vocab_size + n) // VOCAB_ALIGN) * VOCAB_ALIGN
        return cls(text_vocab_size, llm.speech_token_size, vocab, family)

    @classmethod
    def from_config(cls, config: dict) -> "SpeechVocab":
        c = config["cosyserve"]
        family = "cosyvoice3" if str(c.get("format", "")).startswith("cosyvoice3") else "cosyvoice2"
        return cls(int(c["speech_token_offset"]), int(c["speech_token_size"]), int(config["vocab_size"]), family)


def added_token_names(speech_token_size: int, family: str = "cosyvoice2") -> list[str]:
    """Names of the tokens appended after the text vocabulary, in id order."""
    if family == "cosyvoice3":
        names = [f"<|s_{i}|>" for i in range(speech_token_size + 200)]
        for i, n in enumerate(("<|sos|>", "<|eos1|>", "<|task_id|>", "<|fill|>")):
            names[speech_token_size + i] = n
        return names
    return [f"<|s_{i}|>" for i in range(speech_token_size)] + [
        "<|eos1|>", "<|eos2|>", "<|fill|>", "<|sos|>", "<|task_id|>"
    ]


def build_export(lm: SpeechLM, text_vocab_size: int, dtype: torch.dtype = torch.bfloat16):
    """Build the exported weights.

    Args:
      lm: the native speech LM (any device/dtype).
      text_vocab_size: ``T``, the size of the text tokenizer with CosyVoice's special
        tokens (151663 for the official BlankEN folder with CosyVoice2's tokens, 151924 with
        CosyVoice3's); must not exceed the Qwen embedding rows.
      dtype: dtype of the written weights.
    Returns ``(state_dict, config_dict, bias [S+3] / [S+200] float32, SpeechVocab)`` where the
    state dict uses the standard HF ``Qwen2ForCausalLM`` key names.
    """
    cfg = lm.cfg
    s = cfg.speech_token_size
    emb_rows = lm.backbone.embed_tokens.weight.shape[0]
    if not 0 < text_vocab_size <= emb_rows:
        raise ValueError(f"text vocabulary size {text_vocab_size} must be in 1..{emb_rows}")
    sv = SpeechVocab.for_model(cfg, text_vocab_size)
    vocab = sv.vocab_size
    h = lm.cfg.llm_input_size

    def cpu(t):
        return t.detach().to("cpu", torch.float32, copy=True)  # own storage: the LM fuses projections into shared tensors

    embed = torch.zeros(vocab, h)
    embed[:text_vocab_size] = cpu(lm.backbone.embed_tokens.weight[:text_vocab_size])
    embed[sv.speech_token_offset : sv.speech_token_offset + cfg.num_speech_rows] = cpu(lm.speech_embedding.weight)
    if cfg.has_llm_embedding:  # CosyVoice2: sos / task id have a table of their own
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
            "format": f"{sv.family}-speech-lm",
            "speech_token_offset": sv.speech_token_offset,
            "speech_token_size": s,
            "sos_token_id": sv.sos_token_id,
            "task_id_token_id": sv.task_id_token_id,
            "stop_token_ids": list(sv.stop_token_ids),
            "min_len_mask_token_id": sv.min_len_mask_token_id,
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
    tok = TextTokenizer(md.qwen, version=cfg.model_family)
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
    names = added_token_names(cfg.llm.speech_token_size, sv.family)
    hf_tok.add_tokens(names, special_tokens=True)
    first = hf_tok.convert_tokens_to_ids(names[0])
    last = hf_tok.convert_tokens_to_ids(names[-1])
    if first != sv.speech_token_offset or last != sv.speech_token_offset + sv.num_appended - 1:
        raise RuntimeError(f"tokenizer ids of the appended tokens ({first}..{last}) do not match the export layout")
    hf_tok.chat_template = (
        "{%- for message in messages %}{%- if message['role'] == 'user' %}"
        "{{- '<|sos|>' + message['content'] + '<|task_id|>' }}"
        "{%- elif message['role'] == 'assistant' %}{{- message['content'] }}{%- endif %}{%- endfor %}"
    )
    hf_tok.save_pretrained(str(out))
    return sv
