"""Exception types shared by every layer of cosyserve.

Every error that a user can cause (a bad model directory, bad input audio, unknown
voice, ...) is a subclass of :class:`CosyServeError`; protocol adapters translate them
into HTTP 4xx / gRPC INVALID_ARGUMENT / a one-line CLI message without traceback.
"""

from __future__ import annotations


class CosyServeError(Exception):
    """Base class of all errors cosyserve raises on purpose."""


class ModelDirError(CosyServeError):
    """The model directory is missing a file or has an unusable layout."""


class ConfigError(ModelDirError):
    """``cosyvoice2.yaml`` (or the Qwen2 ``config.json``) cannot be understood."""


class CheckpointError(ModelDirError):
    """A checkpoint's keys or shapes do not match the architecture built from the yaml."""


class InvalidInputError(CosyServeError, ValueError):
    """A request field (text, audio, voice id, parameter) is invalid.

    ``field`` names the offending request field so that servers can report it.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class VoiceNotFoundError(InvalidInputError):
    """A request names a voice id that is not registered."""
