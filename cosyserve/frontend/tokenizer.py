"""CosyVoice2's text tokenizer: the Qwen2 byte-level BPE of ``CosyVoice-BlankEN`` plus 17 tokens.

Upstream (``cosyvoice.tokenizer.tokenizer.CosyVoice2Tokenizer``) loads the folder with
``transformers.AutoTokenizer`` and then calls ``add_special_tokens`` with
``eos``/``pad`` = ``<|endoftext|>`` and an ``additional_special_tokens`` list. Of that
list ``<|im_start|>``/``<|im_end|>`` already exist (151644/151645); the other 17 are
appended in list order, so ``<|endofprompt|>`` = 151646, ``[breath]`` = 151647, ...,
``[mn]`` = 151662. Encoding adds no BOS/EOS; decoding skips special tokens.
:class:`TextTokenizer` does exactly that and checks the resulting ids.

Which files: the official ``merges.txt`` holds 134 935 merges, an order-preserving subset
of the stock Qwen2 list (151 387). Tokenizing with a stock Qwen ``tokenizer.json``
therefore gives different (longer, multi-character) CJK tokens than CosyVoice2 was trained
with. Only ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json`` are used: if the
folder also contains a ``tokenizer.json`` (which ``AutoTokenizer`` would prefer), the three
files are loaded from a private staging folder instead and a warning is logged.

No text normalisation happens here (upstream's ttsfrd / wetext step is a separate concern).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterable

from ..errors import InvalidInputError, ModelDirError

log = logging.getLogger(__name__)

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
REQUIRED_FILES = (VOCAB_FILE, MERGES_FILE, TOKENIZER_CONFIG_FILE)
#: Files AutoTokenizer would prefer over vocab.json + merges.txt.
_OVERRIDING_FILES = ("tokenizer.json",)

#: ``eos_token``/``pad_token`` set by upstream's CosyVoice2Tokenizer.
ENDOFTEXT = "<|endoftext|>"
#: ``additional_special_tokens`` of upstream's CosyVoice2Tokenizer, in its order (order = ids).
COSYVOICE2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]",
    "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)


def _check_files(folder: Path) -> None:
    if not folder.is_dir():
        raise ModelDirError(f"tokenizer folder not found: '{folder}'")
    for name in REQUIRED_FILES:
        p = folder / name
        if not p.is_file():
            raise ModelDirError(f"tokenizer file missing: '{p}'")
    for name in (VOCAB_FILE, TOKENIZER_CONFIG_FILE):
        p = folder / name
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelDirError(f"tokenizer file '{p}' is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or (name == VOCAB_FILE and not data):
            raise ModelDirError(f"tokenizer file '{p}' must hold a non-empty JSON object")
        if name == VOCAB_FILE and not all(isinstance(v, int) for v in data.values()):
            raise ModelDirError(f"tokenizer file '{p}' must map token strings to integer ids")
    p = folder / MERGES_FILE
    try:
        with open(p, encoding="utf-8") as fh:
            lines = [ln for ln in (fh.readline() for _ in range(8)) if ln]
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"tokenizer file '{p}' is not readable UTF-8 text: {exc}") from None
    body = [ln for ln in lines if not ln.startswith("#version")]
    if not body or any(len(ln.rstrip("\n").split(" ")) != 2 for ln in body):
        raise ModelDirError(f"tokenizer file '{p}' is not a BPE merge list ('<left> <right>' per line)")


class TextTokenizer:
    """Text <-> Qwen2 token ids as CosyVoice2 uses them.

    Args:
        blanken_dir: the ``CosyVoice-BlankEN`` folder of a model directory.

    Attributes:
        special_token_ids: ``{token: id}`` of ``<|endoftext|>`` and all 19 additional
            special tokens.

    Raises:
        ModelDirError: the folder or one of ``vocab.json`` / ``merges.txt`` /
            ``tokenizer_config.json`` is missing or corrupt (the message names the file),
            or the special tokens do not land on consecutive ids after ``<|im_end|>``.

    ``encode``/``decode`` are thread-safe (a lock guards the shared Rust tokenizer).
    """

    def __init__(self, blanken_dir: str | os.PathLike):
        self.path = Path(blanken_dir)
        _check_files(self.path)
        self._lock = threading.Lock()
        self._tok = self._load()
        self.special_token_ids = self._check_special_tokens()

    def _load(self):
        from transformers import AutoTokenizer

        overriding = [n for n in _OVERRIDING_FILES if (self.path / n).exists()]
        try:
            if not overriding:
                tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            else:
                log.warning("%s contains %s; ignoring it and tokenizing with %s only (CosyVoice2's merge list)",
                            self.path, ", ".join(overriding), " + ".join(REQUIRED_FILES))
                with tempfile.TemporaryDirectory(prefix="cosyserve-blanken-") as tmp:
                    for name in REQUIRED_FILES:
                        shutil.copyfile(self.path / name, Path(tmp) / name)
                    tok = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except ModelDirError:
            raise
        except Exception as exc:  # transformers/tokenizers raise many types for bad files
            raise ModelDirError(f"cannot load the tokenizer from '{self.path}' "
                                f"({' + '.join(REQUIRED_FILES)}): {exc}") from None
        try:
            tok.add_special_tokens({
                "eos_token": ENDOFTEXT,
                "pad_token": ENDOFTEXT,
                "additional_special_tokens": list(COSYVOICE2_SPECIAL_TOKENS),
            })
        except Exception as exc:
            raise ModelDirError(f"cannot add CosyVoice2's special tokens to '{self.path}': {exc}") from None
        return tok

    def _check_special_tokens(self) -> dict[str, int]:
        names = (ENDOFTEXT,) + COSYVOICE2_SPECIAL_TOKENS
        ids = {t: self._tok.convert_tokens_to_ids(t) for t in names}
        seq = [ids[t] for t in COSYVOICE2_SPECIAL_TOKENS]
        if any(not isinstance(i, int) for i in seq) or seq != list(range(seq[0], seq[0] + len(seq))) \
                or ids[ENDOFTEXT] != seq[0] - 1:
            raise ModelDirError(
                f"tokenizer in '{self.path}': special tokens got ids {ids}; expected <|endoftext|>, <|im_start|>, "
                "<|im_end|> and the CosyVoice2 tokens on consecutive ids (is tokenizer_config.json the official one?)"
            )
        return ids

    @property
    def hf_tokenizer(self):
        """The underlying ``transformers`` fast tokenizer (shared by this object; copy before mutating)."""
        return self._tok

    def __len__(self) -> int:
        """Vocabulary size including added tokens (151663 for CosyVoice2)."""
        return len(self._tok)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def token_id(self, token: str) -> int:
        """Id of one vocabulary or special token (e.g. ``'<|endofprompt|>'``)."""
        i = self._tok.convert_tokens_to_ids(token)
        if i is None or (i == self._tok.unk_token_id and token != self._tok.unk_token):
            raise KeyError(token)
        return int(i)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text map to their ids; no BOS/EOS).

        Raises:
            InvalidInputError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}", field="text")
        with self._lock:
            return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with special tokens skipped (upstream ``skip_special_tokens=True``)."""
        ids = [int(i) for i in ids]
        with self._lock:
            return self._tok.decode(ids, skip_special_tokens=True)
