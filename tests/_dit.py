"""Shared pieces of the Step-Audio2 DiT token2wav tests: the tiny random-weight model, random
prompts of several lengths, and a stand-in for CUDA graph recording (so graph bookkeeping runs on
CPU)."""

from __future__ import annotations

import torch

from cosyserve.models.dit_token2wav import TINY_SIZE, load_dit_token2wav, write_token2wav_dir

PROMPT_TOKENS = (6, 17, 11, 23)  # different prompt (and so cache) lengths


def tiny_t2w(tmp_path_factory):
    """The tiny DiT token2wav (``TINY_SIZE``, random weights, float32, CPU), one thread."""
    torch.set_num_threads(1)
    return load_dit_token2wav(write_token2wav_dir(tmp_path_factory.mktemp("t2w") / "t2w", TINY_SIZE))


def prompts(seed: int = 0):
    """One ``(prompt tokens [n], prompt mel [2n, 80], embedding [192])`` per ``PROMPT_TOKENS`` entry."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 6561, (n,), generator=g), torch.randn(2 * n, 80, generator=g),
             torch.randn(192, generator=g)) for n in PROMPT_TOKENS]


class Replay:
    """A stand-in CUDA graph: replay() runs the recorded function again (on the same tensors)."""

    def __init__(self, run):
        self.run, self.replays = run, 0

    def replay(self):
        self.replays += 1
        self.run()


def stand_in_record(run, pool, stream, settle_first=True):
    """``models.graphs._record`` replacement: recording runs nothing (as CUDA's)."""
    return Replay(run), None
