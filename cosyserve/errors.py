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


class SettingsError(CosyServeError, ValueError):
    """A server or engine setting cannot be used with this model (e.g. a size below the model's chunk)."""


class InvalidInputError(CosyServeError, ValueError):
    """A request field (text, audio, voice id, parameter) is invalid.

    ``field`` names the offending request field so that servers can report it.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class VoiceNotFoundError(InvalidInputError):
    """A request names a voice id that is not registered."""


#: messages of the CUDA errors that leave a process's context unusable ("sticky" errors in the CUDA
#: runtime documentation: every later call in the process fails with the same error)
STICKY_DEVICE_ERRORS = (
    "illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction",
    "device-side assert", "hardware stack error", "invalid program counter", "uncorrectable ecc",
    "cudaerrorillegaladdress", "cudaerrorlaunchfailure",
)


def device_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a sticky CUDA error: the process's
    device context is corrupt and nothing on that device can run again (CUDA runtime API,
    ``cudaErrorIllegalAddress``, ``cudaErrorLaunchFailure`` and kin). Out-of-memory and other
    recoverable errors are not. A server seeing one exits so its supervisor restarts it
    (:class:`cosyserve.engine.async_engine.AsyncEngine`'s ``on_device_lost``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        msg = str(exc).lower()
        if "out of memory" not in msg and ("cuda error" in msg or "cuda" in type(exc).__name__.lower()
                                           or type(exc).__name__ == "AcceleratorError") \
                and any(s in msg for s in STICKY_DEVICE_ERRORS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
