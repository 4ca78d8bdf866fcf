"""Audio response formats, encoded incrementally as chunks arrive.

========  ==========================================  ============================================
format    bytes                                       how
========  ==========================================  ============================================
``pcm``   raw 16-bit little-endian, mono, 24 kHz      direct
``wav``   RIFF/WAVE 16-bit PCM                        own header; when streaming, the RIFF/data
                                                      sizes are 0xFFFFFFFF ("unknown", as OpenAI)
``flac``  FLAC 16-bit                                 libsndfile (soundfile); sent complete at the
                                                      end (common decoders, libsndfile included,
                                                      reject a FLAC header of unknown length)
``mp3``   MPEG-1/2 layer III                          libsndfile (LAME)
``opus``  Ogg/Opus                                    libsndfile (libopus)
========  ==========================================  ============================================

:class:`StreamEncoder` turns float32 chunks into encoded bytes as they come: ``push``
returns the bytes the encoder produced so far, ``finish`` the rest. libsndfile may seek
back to patch a header when the file is closed; bytes already sent are never changed
(such patches are dropped), which the decoders accept for MP3 (no Xing length tag) and
Opus (pages are complete); FLAC is therefore not sent progressively.
"""

from __future__ import annotations

import io
import struct

import numpy as np

FORMATS = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}
_SF = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> 16-bit little-endian PCM bytes (clipped, rounded)."""
    x = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (np.round(x * 32767.0)).astype("<i2").tobytes()


def wav_header(sample_rate: int, n_samples: int | None) -> bytes:
    """44-byte RIFF header for mono 16-bit PCM; ``n_samples=None`` writes 0xFFFFFFFF sizes."""
    data = 0xFFFFFFFF if n_samples is None else n_samples * 2
    riff = 0xFFFFFFFF if n_samples is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", data))


class _Sink(io.RawIOBase):
    """Seekable write-only buffer that remembers what was already handed out."""

    def __init__(self):
        self.buf = bytearray()
        self.pos = 0
        self.sent = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        end = self.pos + len(b)
        if end > len(self.buf):
            self.buf.extend(b"\0" * (end - len(self.buf)))
        self.buf[self.pos:end] = b
        self.pos = end
        return len(b)

    def read(self, n: int = -1) -> bytes:
        return b""

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else (self.pos + off if whence == 1 else len(self.buf) + off)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        out = bytes(self.buf[self.sent:])
        self.sent = len(self.buf)
        return out


PROGRESSIVE = ("pcm", "wav", "mp3", "opus")


class StreamEncoder:
    """Incremental encoder for one response (see module docstring).

    ``streaming``: return bytes as they are produced (formats in :data:`PROGRESSIVE`);
    otherwise everything comes from :meth:`finish`. Raises ``ValueError`` for an unknown
    format.
    """

    def __init__(self, fmt: str, sample_rate: int, streaming: bool = True):
        if fmt not in FORMATS:
            raise ValueError(f"unsupported response_format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.streaming = streaming and fmt in PROGRESSIVE
        self._started = False
        self._sink = None
        self._sf = None
        self._pcm: list[bytes] = []
        if fmt in _SF:
            import soundfile as sf

            self._sink = _Sink()
            f, sub = _SF[fmt]
            self._sf = sf.SoundFile(self._sink, "w", samplerate=sample_rate, channels=1, format=f, subtype=sub)

    @property
    def media_type(self) -> str:
        return FORMATS[self.fmt]

    def push(self, samples: np.ndarray) -> bytes:
        """Encode a float32 chunk; returns the bytes available now (maybe empty)."""
        if self.fmt in ("pcm", "wav"):
            data = to_pcm16(samples)
            if not self.streaming:
                self._pcm.append(data)
                return b""
            if self.fmt == "wav" and not self._started:
                self._started = True
                return wav_header(self.sample_rate, None) + data
            return data
        self._sf.write(np.asarray(samples, dtype=np.float32))
        return self._sink.take() if self.streaming else b""

    def finish(self) -> bytes:
        """Flush the encoder; returns the remaining bytes (the whole file when not streaming)."""
        if self.fmt in ("pcm", "wav"):
            if self.streaming:
                if self.fmt == "wav" and not self._started:
                    self._started = True
                    return wav_header(self.sample_rate, 0)
                return b""
            data = b"".join(self._pcm)
            return (wav_header(self.sample_rate, len(data) // 2) + data) if self.fmt == "wav" else data
        self._sf.close()
        if self.streaming:
            return self._sink.take()
        return bytes(self._sink.buf)


def encode(samples: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """Encode a whole waveform (non-streaming)."""
    enc = StreamEncoder(fmt, sample_rate, streaming=False)
    enc.push(samples)
    return enc.finish()
