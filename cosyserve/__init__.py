"""cosyserve: a serving runtime for CosyVoice2-family zero-shot text-to-speech."""

__version__ = "0.1.0"
