"""CosyVoice2's / CosyVoice3's text tokenizer: the Qwen2 byte-level BPE of ``CosyVoice-BlankEN``
plus CosyVoice's special tokens.

Upstream (``cosyvoice.tokenizer.tokenizer.CosyVoice2Tokenizer``) loads the folder with
``transformers.AutoTokenizer`` and then calls ``add_special_tokens`` with
``eos``/``pad`` = ``<|endoftext|>`` and an ``additional_special_tokens`` list. Of that
list ``<|im_start|>``/``<|im_end|>`` already exist (151644/151645); the other 17 are
appended in list order, so ``<|endofprompt|>`` = 151646, ``[breath]`` = 151647, ...,
``[mn]`` = 151662. Encoding adds no BOS/EOS; decoding skips special tokens.
:class:`TextTokenizer` does exactly that and checks the resulting ids.

CosyVoice3 (upstream ``CosyVoice3Tokenizer``, ``get_qwen_tokenizer(version='cosyvoice3')``)
appends, after the same 19, ``<|endofsystem|>`` (151663) and 260 pronunciation tokens
(:data:`COSYVOICE3_PHONE_TOKENS`: ARPAbet phones ``[AA]``, ``[AA0]`` ... ``[ZH]`` and pinyin
initials / finals ``[a]`` ... ``[ǜ]``), 151924 ids in all.

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

#: ARPAbet (CMUdict) vowels, each also with lexical stress 0/1/2, and consonants.
_ARPABET_VOWELS = "AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split()
_ARPABET_CONSONANTS = "B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH".split()
#: Pinyin units of CosyVoice3's vocabulary: initials and toneless finals, then toned finals.
_PINYIN_TONELESS = ("a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu j k l m n o ong ou "
                    "p q r s sh t u uang ue un uo w x y z zh").split()
_PINYIN_TONED = (
    "ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo "
    "iǒng iǔ uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn "
    "uǎng uǐ uǒ vè à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng "
    "òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng "
    "ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
).split()
#: CosyVoice3's pronunciation tokens in id order: ``[unit]`` for every unit, sorted by code point.
COSYVOICE3_PHONE_TOKENS: tuple[str, ...] = tuple(
    f"[{u}]" for u in sorted(
        [v + s for v in _ARPABET_VOWELS for s in ("", "0", "1", "2")] + _ARPABET_CONSONANTS
        + _PINYIN_TONELESS + _PINYIN_TONED))
#: ``additional_special_tokens`` of upstream's CosyVoice3Tokenizer, in its order (order = ids).
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = COSYVOICE2_SPECIAL_TOKENS + ("<|endofsystem|>",) + COSYVOICE3_PHONE_TOKENS
#: the special tokens of each tokenizer version (upstream ``get_qwen_tokenizer(version=...)``)
SPECIAL_TOKENS = {"cosyvoice2": COSYVOICE2_SPECIAL_TOKENS, "cosyvoice3": COSYVOICE3_SPECIAL_TOKENS}
#: separates the instruction / prompt transcript from the text (CosyVoice3 requires it in its input)
ENDOFPROMPT = "<|endofprompt|>"
#: the instruction upstream's CosyVoice3 examples put before a zero-shot transcript
DEFAULT_INSTRUCTION = "You are a helpful assistant." + ENDOFPROMPT


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
    """Text <-> Qwen2 token ids as CosyVoice2 / CosyVoice3 use them.

    Args:
        blanken_dir: the ``CosyVoice-BlankEN`` folder of a model directory.
        version: ``"cosyvoice2"`` (19 additional special tokens) or ``"cosyvoice3"`` (280),
            the model family.

    Attributes:
        special_token_ids: ``{token: id}`` of ``<|endoftext|>`` and all additional
            special tokens.

    Raises:
        ModelDirError: the folder or one of ``vocab.json`` / ``merges.txt`` /
            ``tokenizer_config.json`` is missing or corrupt (the message names the file),
            or the special tokens do not land on consecutive ids after ``<|im_end|>``.

    ``encode``/``decode`` are thread-safe (a lock guards the shared Rust tokenizer).
    """

    def __init__(self, blanken_dir: str | os.PathLike, version: str = "cosyvoice2"):
        if version not in SPECIAL_TOKENS:
            raise ValueError(f"unknown tokenizer version {version!r} (known: {', '.join(SPECIAL_TOKENS)})")
        self.version = version
        self.special_tokens = SPECIAL_TOKENS[version]
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
                "additional_special_tokens": list(self.special_tokens),
            })
        except Exception as exc:
            raise ModelDirError(f"cannot add the {self.version} special tokens to '{self.path}': {exc}") from None
        return tok

    def _check_special_tokens(self) -> dict[str, int]:
        names = (ENDOFTEXT,) + self.special_tokens
        ids = {t: self._tok.convert_tokens_to_ids(t) for t in names}
        seq = [ids[t] for t in self.special_tokens]
        if any(not isinstance(i, int) for i in seq) or seq != list(range(seq[0], seq[0] + len(seq))) \
                or ids[ENDOFTEXT] != seq[0] - 1:
            raise ModelDirError(
                f"tokenizer in '{self.path}': special tokens got ids {ids}; expected <|endoftext|>, <|im_start|>, "
                f"<|im_end|> and the {self.version} tokens on consecutive ids (is tokenizer_config.json the official one?)"
            )
        return ids

    @property
    def hf_tokenizer(self):
        """The underlying ``transformers`` fast tokenizer (shared by this object; copy before mutating)."""
        return self._tok

    def __len__(self) -> int:
        """Vocabulary size including added tokens (151663 for CosyVoice2, 151924 for CosyVoice3)."""
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
