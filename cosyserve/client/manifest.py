"""Benchmark manifests: JSONL files of zero-shot TTS requests.

One JSON object per line with ``id``, ``prompt_wav`` (a path relative to the manifest, or
absolute), ``prompt_text`` (its transcript), ``target_text`` and ``language``; other
fields are kept in :attr:`BenchItem.extra`. Blank lines and lines starting with ``#`` are
skipped. The shipped set is ``benchmarks/sets/default`` (see its README).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CosyServeError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_SET = REPO_ROOT / "benchmarks" / "sets" / "default"
REQUIRED = ("id", "prompt_wav", "prompt_text", "target_text")


class ManifestError(CosyServeError):
    """The manifest is missing, unreadable, or has a malformed line (the message names it)."""


@dataclass
class BenchItem:
    """One request of a benchmark set."""

    id: str
    prompt_wav: Path
    prompt_text: str
    target_text: str
    language: str = ""
    extra: dict = field(default_factory=dict)

    def prompt_16k(self) -> np.ndarray:
        """The prompt as float32 samples ``[N]`` at 16 kHz (the KServe ``reference_wav`` rate).

        Raises :class:`~cosyserve.errors.InvalidInputError` for unreadable audio.
        """
        from ..frontend.audio import load_prompt_wav

        return load_prompt_wav(str(self.prompt_wav), 16000)[0].numpy().astype(np.float32)


def resolve_manifest(path: str | Path | None) -> Path:
    """``manifest.jsonl`` of a set folder, or the file itself; ``None`` is the shipped set."""
    if path is None:
        p = DEFAULT_SET
        if not p.is_dir():
            raise ManifestError(f"the default benchmark set ({p}) is not here (installed without the repository?); "
                                "pass --set DIR_OR_JSONL")
    else:
        p = Path(path).expanduser()
    if p.is_dir():
        p = p / "manifest.jsonl"
    if not p.is_file():
        raise ManifestError(f"benchmark manifest {p} does not exist")
    return p


def load_manifest(path: str | Path | None = None, limit: int | None = None) -> list[BenchItem]:
    """Items of a manifest (see module docstring); ``limit`` keeps the first N.

    Raises :class:`ManifestError` naming the line of a malformed entry, a duplicate id or a
    missing prompt file.
    """
    p = resolve_manifest(path)
    items: list[BenchItem] = []
    seen: set[str] = set()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read {p}: {exc}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{p}:{n}: not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise ManifestError(f"{p}:{n}: each line must be a JSON object")
        missing = [k for k in REQUIRED if not isinstance(d.get(k), str) or not d.get(k).strip()]
        if missing:
            raise ManifestError(f"{p}:{n}: missing or empty field(s) {', '.join(missing)}")
        if d["id"] in seen:
            raise ManifestError(f"{p}:{n}: duplicate id {d['id']!r}")
        seen.add(d["id"])
        wav = Path(d["prompt_wav"]).expanduser()
        if not wav.is_absolute():
            wav = p.parent / wav
        if not wav.is_file():
            raise ManifestError(f"{p}:{n}: prompt_wav {wav} does not exist")
        items.append(BenchItem(d["id"], wav, d["prompt_text"], d["target_text"], str(d.get("language", "")),
                               {k: v for k, v in d.items() if k not in REQUIRED and k != "language"}))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise ManifestError(f"{p} has no items")
    return items
