"""Text normalisation and sentence splitting for synthesis.

Follows upstream ``CosyVoiceFrontEnd.text_normalize`` (``cosyvoice/cli/frontend.py`` and
``cosyvoice/utils/frontend_utils.py``):

* text containing ``<|`` and ``|>`` (explicit special tokens) is passed through untouched;
* Chinese text (any CJK ideograph): normaliser, newlines removed, blanks between
  non-ASCII characters removed, ``²``/``³`` spelled out, ``.`` -> ``。``, `` - `` -> ``，``,
  brackets removed, trailing commas -> ``。``, split at sentence punctuation into segments
  of at most 80 characters (segments shorter than 20 are merged into the previous one);
* other text: normaliser, digits spelled out (``inflect``), split at ``. ? ! ; :`` into
  segments of at most 80 tokens with the same merge rule;
* segments consisting only of punctuation/symbols are dropped.

Normaliser: `WeTextProcessing <https://github.com/wenet-e2e/WeTextProcessing>`_ (package
``wetextprocessing``; its Chinese and English FSTs ship inside the wheel, so it works
offline). The Chinese grammar is rebuilt once (about 3 s, cached on disk) with
``remove_interjections=False, remove_erhua=False, traditional_to_simple=False,
full_to_half=False`` so that it never deletes or rewrites what the user wrote, only
verbalises numbers, dates, units, etc. Fallback when it is not installed (or fails):
the rule-based path above without the FST (upstream's behaviour when neither ttsfrd nor
wetext is available). ``normalizer="none"`` disables normalisation.

Guard: normalisation must never silently drop user text. After normalising, every CJK
ideograph of the input must still appear, in order, in the output, and so must every
Latin letter (case-insensitively, as a subsequence: "Dr." -> "doctor" passes). If not,
the sentence is used un-normalised and a warning is logged.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import unicodedata
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_CJK = re.compile(r"[\u4e00-\u9fff]")
_SPLIT_ZH = "。？！；：、.?!;"
_SPLIT_EN = ".?!;:"


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def _is_only_punctuation(text: str) -> bool:
    return all(unicodedata.category(c)[0] in "PSZ" for c in text)


def _subsequence(needle: list[str], hay: str) -> bool:
    it = iter(hay)
    return all(any(c == h for h in it) for c in needle)


def keeps_content(src: str, out: str) -> bool:
    """True if every CJK ideograph and Latin letter of ``src`` survives, in order, in ``out``."""
    han = [c for c in src if _CJK.match(c)]
    if han and not _subsequence(han, "".join(c for c in out if _CJK.match(c))):
        return False
    letters = [c.lower() for c in src if c.isascii() and c.isalpha()]
    return not letters or _subsequence(letters, out.lower())


def _replace_blank(text: str) -> str:
    """Drop spaces unless both neighbours are non-space ASCII (upstream ``replace_blank``)."""
    out = []
    for i, c in enumerate(text):
        if c == " ":
            prev = text[i - 1] if i > 0 else " "
            nxt = text[i + 1] if i + 1 < len(text) else " "
            if prev.isascii() and prev != " " and nxt.isascii() and nxt != " ":
                out.append(c)
        else:
            out.append(c)
    return "".join(out)


def _remove_bracket(text: str) -> str:
    for a in ("（", "）", "【", "】", "`"):
        text = text.replace(a, "")
    return text.replace("——", " ")


def split_paragraph(
    text: str,
    length: Callable[[str], int],
    lang: str,
    max_len: int = 80,
    min_len: int = 60,
    merge_len: int = 20,
) -> list[str]:
    """Split at sentence punctuation, then pack sentences into segments (upstream rules).

    ``length`` measures a segment (characters for Chinese, tokens otherwise). A segment is
    closed when adding the next sentence would exceed ``max_len`` and it already has more
    than ``min_len``; a final segment shorter than ``merge_len`` joins the previous one.
    Nothing is dropped: text after the last punctuation mark ends a sentence.
    """
    marks = _SPLIT_ZH if lang == "zh" else _SPLIT_EN
    if text[-1] not in marks:
        text += "。" if lang == "zh" else "."
    sentences: list[str] = []
    start = 0
    i = 0
    while i < len(text):
        if text[i] in marks:
            end = i + 1
            if end < len(text) and text[end] in "\"”":
                end += 1
            if text[start:i]:
                sentences.append(text[start:end])
            elif sentences:  # a mark right after a mark: keep it with the previous sentence
                sentences[-1] += text[start:end]
            start = end
            i = end
            continue
        i += 1
    segments: list[str] = []
    cur = ""
    for s in sentences:
        if length(cur + s) > max_len and length(cur) > min_len:
            segments.append(cur)
            cur = ""
        cur += s
    if cur:
        if length(cur) < merge_len and segments:
            segments[-1] += cur
        else:
            segments.append(cur)
    return segments


class _WeText:
    """Lazily built WeTextProcessing normalisers (thread-safe, built once per process)."""

    _lock = threading.Lock()
    _zh = None
    _en = None

    @classmethod
    def available(cls) -> bool:
        try:
            import tn  # noqa: F401
        except Exception:  # ImportError, or pynini failing to load
            return False
        return True

    @classmethod
    def cache_dir(cls) -> Path:
        base = os.environ.get("COSYSERVE_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cosyserve"
        )
        p = Path(base) / "wetext-zh-keep"
        p.mkdir(parents=True, exist_ok=True)
        return p

    @staticmethod
    def _quiet() -> None:
        # WeTextProcessing installs its own INFO-level "wetext" logger on import.
        lg = logging.getLogger("wetext")
        lg.setLevel(logging.WARNING)
        lg.propagate = False

    @classmethod
    def zh(cls):
        with cls._lock:
            if cls._zh is None:
                from tn.chinese.normalizer import Normalizer

                cls._quiet()
                d = cls.cache_dir()
                fresh = not (d / "zh_tn_tagger.fst").exists()
                cls._zh = Normalizer(cache_dir=str(d), overwrite_cache=fresh, remove_interjections=False,
                                     remove_erhua=False, traditional_to_simple=False, full_to_half=False)
            return cls._zh

    @classmethod
    def en(cls):
        with cls._lock:
            if cls._en is None:
                from tn.english.normalizer import Normalizer

                cls._quiet()
                cls._en = Normalizer()
            return cls._en


class TextFrontend:
    """Normalise and split synthesis text; see the module docstring for the rules.

    Args:
      token_length: number of LM text tokens of a string (used to size English segments).
      normalizer: ``"auto"`` (WeTextProcessing if installed, else rules), ``"wetext"``
        (required; :class:`RuntimeError` if missing), ``"rules"`` or ``"none"``.
    """

    def __init__(self, token_length: Callable[[str], int], normalizer: str = "auto"):
        if normalizer not in ("auto", "wetext", "rules", "none"):
            raise ValueError(f"unknown normalizer {normalizer!r}")
        if normalizer == "wetext" and not _WeText.available():
            raise RuntimeError("normalizer 'wetext' needs the wetextprocessing package (pip install wetextprocessing)")
        self.token_length = token_length
        self.mode = normalizer
        self.use_wetext = normalizer in ("auto", "wetext") and _WeText.available()
        self._inflect = None

    @property
    def backend(self) -> str:
        """``wetext``, ``rules`` or ``none``: what actually normalises."""
        return "none" if self.mode == "none" else ("wetext" if self.use_wetext else "rules")

    def _fst(self, text: str, zh: bool) -> str:
        if not self.use_wetext:
            return text
        try:
            out = (_WeText.zh() if zh else _WeText.en()).normalize(text)
        except Exception as exc:  # a grammar failure must not fail the request
            log.warning("text normaliser failed (%s); using the text as written", exc)
            return text
        if not out.strip() or not keeps_content(text, out):
            log.warning("text normaliser would drop content from %r (-> %r); using the text as written", text, out)
            return text
        return out

    def _spell_numbers(self, text: str) -> str:
        if not any(c.isdigit() for c in text):
            return text
        if self._inflect is None:
            try:
                import inflect

                self._inflect = inflect.engine()
            except ImportError:
                return text
        return re.sub(r"\d+", lambda m: self._inflect.number_to_words(m.group(0)), text)

    def warmup(self) -> None:
        """Build/load the normaliser grammars now instead of on the first request."""
        if self.use_wetext:
            _WeText.zh()
            _WeText.en()

    def normalize(self, text: str) -> tuple[str, str]:
        """Normalise one text; returns ``(text, lang)`` with ``lang`` ``"zh"`` or ``"en"``."""
        text = text.strip()
        if self.mode == "none":
            return text, "zh" if contains_chinese(text) else "en"
        if contains_chinese(text):
            text = self._fst(text, zh=True)
            text = text.replace("\n", "")
            text = _replace_blank(text)
            text = text.replace("²", "平方").replace("³", "立方")
            text = text.replace(".", "。").replace(" - ", "，")
            text = _remove_bracket(text)
            text = re.sub(r"[，,、]+$", "。", text)
            return text, "zh"
        text = self._fst(text, zh=False)
        return self._spell_numbers(text), "en"

    def split(self, text: str) -> list[str]:
        """Normalised segments to synthesise in order (upstream ``text_normalize(split=True)``)."""
        if "<|" in text and "|>" in text:
            return [text]
        if not text.strip():
            return []
        norm, lang = self.normalize(text)
        if not norm:
            return []
        length = len if lang == "zh" else self.token_length
        segs = split_paragraph(norm, length, lang)
        return [s for s in segs if not _is_only_punctuation(s)]

    def prompt(self, text: str) -> str:
        """Normalised prompt transcript (upstream ``text_normalize(split=False)``)."""
        if "<|" in text and "|>" in text:
            return text
        return self.normalize(text)[0] if text.strip() else ""
