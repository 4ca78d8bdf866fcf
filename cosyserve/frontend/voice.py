"""Voices: reusable zero-shot prompts, and the on-disk voice store.

A voice is everything the models need from a reference recording, computed once:

=========================  ======================  ===============================================
field                      tensor                  meaning
=========================  ======================  ===============================================
``prompt_text_ids``        int32 ``[Lp]``          text tokens of the transcript (LM prompt)
``llm_speech_token``       int32 ``[T]``           speech tokens fed to the LM after the text
``flow_speech_token``      int32 ``[T]``           speech tokens conditioning the flow
``speech_feat``            float32 ``[2T, 80]``    prompt log-mel (50 frames/s) for the flow
``llm_embedding``          float32 ``[192]``       speaker embedding (unused by Qwen2LM, kept)
``flow_embedding``         float32 ``[192]``       speaker embedding (CAM++) for the flow
=========================  ======================  ===============================================

plus the transcript string. For a zero-shot voice the LM and flow tokens (and the two
embeddings) are the same; a cross-lingual voice has no LM prompt (empty text and tokens).

Store: one ``<id>.safetensors`` file per voice in a directory (tensors + JSON metadata
in the safetensors header), written atomically (a hidden temporary file ``.<id>.*.tmp``,
flushed to disk, then ``os.replace``), so a crash -- even SIGKILL mid-write -- never leaves a
half-written voice and the store survives restarts. Temporary files are never listed or
loaded (their names are not voice ids) and those older than ``STALE_TMP_S`` (left by a
crash) are removed when a store is opened. Ids are validated
(``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}``, no path tricks).

Interchange: ``spk2info.pt`` in upstream's format (``CosyVoice2.add_zero_shot_spk`` +
``save_spkinfo``: ``prompt_text`` ids ``[1, L]``, ``llm_prompt_speech_token``,
``flow_prompt_speech_token``, ``prompt_speech_feat [1, T, 80]``, ``llm_embedding``,
``flow_embedding`` and their ``*_len``), and import of the speaker-cache format used by
CosyVoice's Triton runtime / async_cosyvoice (``prompt_text`` str, ``prompt_text_token``,
``speech_token``, ``speech_feat``, ``embedding``). Tensors round-trip bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidInputError, VoiceNotFoundError

VOICE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
#: a temporary voice file older than this (seconds) was left by a crashed writer; opening a
#: store removes it (younger ones may belong to another process writing right now)
STALE_TMP_S = 60.0
_TENSORS = ("prompt_text_ids", "llm_speech_token", "flow_speech_token", "speech_feat", "llm_embedding", "flow_embedding")


def validate_voice_id(voice_id: str, field_name: str = "voice") -> str:
    """Return ``voice_id`` if valid, else raise :class:`InvalidInputError` naming ``field_name``."""
    if not isinstance(voice_id, str) or not VOICE_ID_RE.match(voice_id) or voice_id.endswith(".tmp"):
        raise InvalidInputError(
            f"invalid voice id {voice_id!r}: use 1-64 characters from A-Z a-z 0-9 _ . - starting with a letter or digit",
            field=field_name,
        )
    return voice_id


def flow_prompt_digest(voice) -> bytes:
    """A 16-byte content key of a voice's flow prompt: its ``flow_speech_token``, ``speech_feat`` and
    ``flow_embedding`` (shapes, dtypes and values; any object with those tensors). Two voices with the same
    flow prompt share the flow's prompt prefix (:class:`~cosyserve.engine.token2wav.PromptPrefixes`)."""
    h = hashlib.blake2b(digest_size=16)
    for t in (voice.flow_speech_token, voice.speech_feat, voice.flow_embedding):
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


@dataclass
class Voice:
    """A zero-shot prompt (see module docstring for the tensors). All tensors are on the CPU; they are
    not changed after the voice is made (:attr:`flow_prompt_key` is computed once)."""

    id: str
    prompt_text: str
    prompt_text_ids: torch.Tensor
    llm_speech_token: torch.Tensor
    flow_speech_token: torch.Tensor
    speech_feat: torch.Tensor
    llm_embedding: torch.Tensor
    flow_embedding: torch.Tensor
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.prompt_text_ids = self.prompt_text_ids.reshape(-1).to(torch.int32)
        self.llm_speech_token = self.llm_speech_token.reshape(-1).to(torch.int32)
        self.flow_speech_token = self.flow_speech_token.reshape(-1).to(torch.int32)
        self.speech_feat = self.speech_feat.reshape(-1, self.speech_feat.shape[-1]).to(torch.float32)
        self.llm_embedding = self.llm_embedding.reshape(-1).to(torch.float32)
        self.flow_embedding = self.flow_embedding.reshape(-1).to(torch.float32)

    @functools.cached_property
    def flow_prompt_key(self) -> bytes:
        """:func:`flow_prompt_digest` of this voice, computed on first use (~0.2 ms for a 3.5 s prompt) and
        kept: the token2wav stage reads it for every streaming chunk that may start from a prompt prefix."""
        return flow_prompt_digest(self)

    @property
    def duration_s(self) -> float:
        """Prompt length in seconds (speech tokens at 25/s)."""
        return self.flow_speech_token.numel() / 25.0

    def info(self) -> dict:
        """JSON-able summary (no tensors)."""
        return {
            "id": self.id,
            "prompt_text": self.prompt_text,
            "prompt_tokens": int(self.flow_speech_token.numel()),
            "duration_s": round(self.duration_s, 3),
            **{k: v for k, v in self.meta.items() if k not in ("prompt_text",)},
        }

    @classmethod
    def from_features(cls, voice_id: str, prompt_text: str, prompt_text_ids, speech_token, speech_feat, embedding,
                      meta: dict | None = None) -> "Voice":
        """A zero-shot voice: the same tokens/embedding for LM and flow."""
        return cls(voice_id, prompt_text, torch.as_tensor(prompt_text_ids), speech_token.clone(), speech_token.clone(),
                   speech_feat, embedding.clone(), embedding.clone(), dict(meta or {}))

    def as_cross_lingual(self, voice_id: str | None = None) -> "Voice":
        """This voice without LM prompt (upstream ``frontend_cross_lingual`` deletes ``prompt_text`` and
        ``llm_prompt_speech_token``); flow tokens, features and embeddings are kept."""
        empty = torch.zeros(0, dtype=torch.int32)
        return Voice(voice_id or self.id, "", empty, empty.clone(), self.flow_speech_token.clone(),
                     self.speech_feat.clone(), self.llm_embedding.clone(), self.flow_embedding.clone(),
                     {**self.meta, "mode": "cross_lingual"})

    def as_instruct2(self, instruct_text: str, instruct_ids, voice_id: str | None = None) -> "Voice":
        """This voice with ``instruct_ids`` (int ``[L]``) as the LM's prompt text and no LM prompt speech
        (upstream ``frontend_instruct2``); flow tokens, features and embeddings are kept."""
        return Voice(voice_id or self.id, instruct_text, torch.as_tensor(instruct_ids),
                     torch.zeros(0, dtype=torch.int32), self.flow_speech_token.clone(), self.speech_feat.clone(),
                     self.llm_embedding.clone(), self.flow_embedding.clone(), {**self.meta, "mode": "instruct2"})

    # ---- upstream spk2info entries
    def to_spk2info(self) -> dict:
        def ln(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return torch.tensor([t.shape[dim]], dtype=torch.int32)

        return {
            "prompt_text": self.prompt_text_ids[None].clone(),
            "prompt_text_len": ln(self.prompt_text_ids),
            "llm_prompt_speech_token": self.llm_speech_token[None].clone(),
            "llm_prompt_speech_token_len": ln(self.llm_speech_token),
            "flow_prompt_speech_token": self.flow_speech_token[None].clone(),
            "flow_prompt_speech_token_len": ln(self.flow_speech_token),
            "prompt_speech_feat": self.speech_feat[None].clone(),
            "prompt_speech_feat_len": ln(self.speech_feat),
            "llm_embedding": self.llm_embedding[None].clone(),
            "flow_embedding": self.flow_embedding[None].clone(),
        }

    @classmethod
    def from_spk2info(cls, voice_id: str, entry: dict, prompt_text: str = "") -> "Voice":
        """Build from an upstream or Triton-runtime speaker-cache entry; raises InvalidInputError."""
        if not isinstance(entry, dict):
            raise InvalidInputError(f"spk2info entry {voice_id!r} is not a dict", field="spk2info")

        def t(*names):
            for n in names:
                v = entry.get(n)
                if isinstance(v, torch.Tensor):
                    return v.detach().cpu()
            return None

        if "flow_prompt_speech_token" in entry or "prompt_speech_feat" in entry:  # upstream format
            flow_tok = t("flow_prompt_speech_token")
            feat = t("prompt_speech_feat")
            flow_emb = t("flow_embedding", "llm_embedding")
            if flow_tok is None or feat is None or flow_emb is None:
                raise InvalidInputError(f"spk2info entry {voice_id!r} lacks flow tokens, features or embedding",
                                        field="spk2info")
            text_ids = t("prompt_text")
            llm_tok = t("llm_prompt_speech_token")
            llm_emb = t("llm_embedding")
            v = cls(voice_id, prompt_text or str(entry.get("prompt_text_str", "")),
                    text_ids if text_ids is not None else torch.zeros(0, dtype=torch.int32),
                    llm_tok if llm_tok is not None else torch.zeros(0, dtype=torch.int32),
                    flow_tok, feat, llm_emb if llm_emb is not None else torch.zeros(0), flow_emb)
        elif "speech_token" in entry and "speech_feat" in entry:  # Triton runtime / async_cosyvoice
            tok, feat, emb = t("speech_token"), t("speech_feat"), t("embedding")
            ids = t("prompt_text_token")
            if tok is None or feat is None or emb is None:
                raise InvalidInputError(f"spk2info entry {voice_id!r} lacks speech_token/speech_feat/embedding",
                                        field="spk2info")
            text = entry.get("prompt_text") if isinstance(entry.get("prompt_text"), str) else prompt_text
            v = cls(voice_id, text or "", ids if ids is not None else torch.zeros(0, dtype=torch.int32),
                    tok, tok.clone(), feat, emb, emb.clone(),
                    {k: entry[k] for k in ("name",) if isinstance(entry.get(k), str)})
        else:
            raise InvalidInputError(f"spk2info entry {voice_id!r} has an unknown layout: keys {sorted(entry)}",
                                    field="spk2info")
        v.validate()
        return v

    def validate(self) -> None:
        """Check shapes are consistent (raises :class:`InvalidInputError`)."""
        if self.flow_speech_token.numel() == 0:
            raise InvalidInputError(f"voice {self.id!r} has no prompt speech tokens", field="voice")
        if self.speech_feat.ndim != 2 or self.speech_feat.shape[0] == 0:
            raise InvalidInputError(f"voice {self.id!r} has no prompt features", field="voice")
        if self.flow_embedding.numel() == 0:
            raise InvalidInputError(f"voice {self.id!r} has no speaker embedding", field="voice")


def _fsync_dir(path: Path) -> None:
    """Persist a rename in ``path`` (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class VoiceStore:
    """Directory of voices, one ``<id>.safetensors`` per voice (see module docstring).

    Safe for concurrent readers and writers in one process (a lock serialises writes;
    files are replaced atomically, so readers never see partial files).
    """

    SUFFIX = ".safetensors"

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Voice]] = {}
        self.removed_temporaries = self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> list[str]:
        """Delete ``.<id>.*.tmp`` files (and ``.tmp*`` ones that safetensors' own atomic writes
        left in earlier versions) older than :data:`STALE_TMP_S` (a writer killed between creating
        and renaming its file); returns their names. Errors are ignored (another process may
        remove them first)."""
        gone, now = [], time.time()
        for p in {*self.root.glob(".*.tmp"), *self.root.glob(".tmp*")}:
            try:
                if now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()
                    gone.append(p.name)
            except OSError:
                pass
        return gone

    def path(self, voice_id: str) -> Path:
        return self.root / f"{validate_voice_id(voice_id)}{self.SUFFIX}"

    def __contains__(self, voice_id: str) -> bool:
        try:
            return self.path(voice_id).is_file()
        except InvalidInputError:
            return False

    def ids(self) -> list[str]:
        return sorted(p.name[: -len(self.SUFFIX)] for p in self.root.glob(f"*{self.SUFFIX}")
                      if VOICE_ID_RE.match(p.name[: -len(self.SUFFIX)]))

    def add(self, voice: Voice, overwrite: bool = False) -> None:
        """Write ``voice`` atomically. Raises :class:`InvalidInputError` if it exists and
        ``overwrite`` is false, or if the voice is inconsistent."""
        from safetensors.torch import save as to_bytes

        voice.validate()
        target = self.path(voice.id)
        tensors = {k: getattr(voice, k).contiguous().clone() for k in _TENSORS}  # no shared storage
        meta = {"prompt_text": voice.prompt_text, "created": voice.meta.get("created", time.time()), **voice.meta}
        with self._lock:
            if target.exists() and not overwrite:
                raise InvalidInputError(f"voice {voice.id!r} already exists", field="name")
            # serialised here and written to our own temporary: safetensors' save_file writes through
            # a hidden ``.tmpXXXXXX`` of its own (0.8), which a kill would leave behind
            data = to_bytes(tensors, metadata={"cosyserve": json.dumps(meta, ensure_ascii=False)})
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{voice.id}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:  # on disk before it gets its name (power loss, not only crashes)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
                _fsync_dir(self.root)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._cache.pop(voice.id, None)

    def get(self, voice_id: str) -> Voice:
        """Load a voice; raises :class:`VoiceNotFoundError` if it is not registered."""
        from safetensors import safe_open

        p = self.path(voice_id)
        try:
            mtime = p.stat().st_mtime_ns
        except FileNotFoundError:
            raise VoiceNotFoundError(f"unknown voice {voice_id!r}", field="voice") from None
        hit = self._cache.get(voice_id)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        with safe_open(str(p), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("cosyserve", "{}"))
            t = {k: f.get_tensor(k) for k in _TENSORS}
        text = meta.pop("prompt_text", "")
        v = Voice(voice_id, text, meta=meta, **t)
        self._cache[voice_id] = (mtime, v)
        return v

    def list(self) -> list[dict]:
        out = []
        for vid in self.ids():
            try:
                out.append(self.get(vid).info())
            except Exception:  # a corrupt file must not break listing
                out.append({"id": vid, "error": "unreadable voice file"})
        return out

    def remove(self, voice_id: str) -> None:
        p = self.path(voice_id)
        with self._lock:
            try:
                p.unlink()
            except FileNotFoundError:
                raise VoiceNotFoundError(f"unknown voice {voice_id!r}", field="voice") from None
            self._cache.pop(voice_id, None)

    def export_spk2info(self, path: str | Path, ids: list[str] | None = None) -> list[str]:
        """Write voices (all by default) as an upstream ``spk2info.pt``; returns the ids."""
        ids = self.ids() if ids is None else ids
        data = {vid: self.get(vid).to_spk2info() for vid in ids}
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(data, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ids

    def import_spk2info(self, path: str | Path, overwrite: bool = False) -> list[str]:
        """Add every speaker of an upstream or Triton-runtime ``spk2info.pt``; returns ids."""
        try:
            data = torch.load(str(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise InvalidInputError(f"{path} not found", field="spk2info") from None
        except Exception as exc:
            raise InvalidInputError(f"{path} is not a readable spk2info.pt ({type(exc).__name__})", field="spk2info") from None
        if not isinstance(data, dict):
            raise InvalidInputError(f"{path} does not contain a dict of speakers", field="spk2info")
        voices = [Voice.from_spk2info(validate_voice_id(str(k), "spk2info"), v) for k, v in data.items()]
        if not overwrite:
            clash = [v.id for v in voices if v.id in self]
            if clash:
                raise InvalidInputError(f"voices already exist: {', '.join(clash)} (use overwrite)", field="spk2info")
        for v in voices:
            self.add(v, overwrite=overwrite)
        return [v.id for v in voices]
