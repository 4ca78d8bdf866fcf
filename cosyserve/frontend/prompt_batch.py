"""Batching of per-request prompt extraction across concurrent requests (asyncio).

A request that carries its own reference audio needs the speech tokenizer and CAM++ before
it can enter the engine. :class:`PromptBatcher` lets concurrent requests share those calls:

1. each request runs the per-request part (decoding, resampling, prompt mel, whisper log-mel,
   fbank: :meth:`PromptExtractor.prepare`) in a worker thread, then queues a
   :class:`PromptJob` (its prepared input and a future);
2. one runner task takes every queued job — the ones that arrived within ``window_s`` of the
   first when it was idle, and afterwards whatever queued while the previous batch ran — up to
   ``max_batch``, and runs :meth:`PromptExtractor.finish` on them in a worker thread: ONE
   speech-tokenizer forward for the batch (padded, per-item masks, on the serving device with
   the PyTorch backend) and CAM++ for each item back to back (onnxruntime; CUDA execution
   provider when available);
3. each job's future gets its features, or its own error.

Results are identical to unbatched extraction (the tokenizer's padding reaches no valid
position; CAM++ runs each item alone). The runner exists only while there is work (no polling,
no global state); a request that goes away while queued is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

from .frontend import Frontend
from .prompt import PromptFeatures, PromptInput
from .voice import Voice

log = logging.getLogger(__name__)

#: default time the first prompt of an idle batcher waits for others to join, seconds
DEFAULT_WINDOW_S = 0.002
#: default largest batch
DEFAULT_MAX_BATCH = 32


@dataclass
class PromptJob:
    """One queued prompt: its prepared input and the future its result goes to."""

    prompt: PromptInput
    future: asyncio.Future


class PromptBatcher:
    """Shares speech-tokenizer and CAM++ calls between concurrent prompt extractions.

    Args:
        frontend: the model directory's :class:`Frontend` (its ``prompts`` extractor is used).
        window_s: how long the first prompt of an idle batcher waits for company (seconds,
            >= 0); later batches take whatever queued while the previous one ran.
        max_batch: largest number of prompts per network call (>= 1).

    Must be used from one event loop (the server's). Raises ValueError for bad settings.
    """

    def __init__(self, frontend: Frontend, window_s: float = DEFAULT_WINDOW_S, max_batch: int = DEFAULT_MAX_BATCH):
        if window_s < 0 or max_batch < 1:
            raise ValueError(f"bad prompt batcher settings: window_s={window_s}, max_batch={max_batch}")
        self.frontend = frontend
        self.window_s = float(window_s)
        self.max_batch = int(max_batch)
        self._queue: deque[PromptJob] = deque()
        self._runner: asyncio.Task | None = None
        #: sizes of the batches run so far (most recent last; bounded)
        self.batch_sizes: deque[int] = deque(maxlen=1024)

    async def extract(self, prompt: PromptInput) -> PromptFeatures:
        """Features of one prepared prompt, computed in a batch with any others queued.

        Raises the item's own error (e.g. :class:`~cosyserve.errors.InvalidInputError`).
        """
        loop = asyncio.get_running_loop()
        job = PromptJob(prompt, loop.create_future())
        self._queue.append(job)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run(), name="prompt-batcher")
        return await job.future

    async def make_voice(self, voice_id: str, audio, transcript: str, meta: dict | None = None) -> Voice:
        """:meth:`Frontend.make_voice` with the network part batched: ``audio`` is a path, bytes,
        a binary file or ``(waveform [C, N] float32, sample_rate)``. Raises InvalidInputError
        for bad audio, an invalid id or an empty transcript."""
        fe = self.frontend
        fe.check_voice_request(voice_id, transcript)
        prompt = await asyncio.to_thread(lambda: fe.prompts.prepare(*fe.prompt_input(audio)))
        feats = await self.extract(prompt)
        return fe.voice_from_prompt(voice_id, transcript, feats, meta)

    async def _run(self) -> None:
        if self.window_s > 0:
            await asyncio.sleep(self.window_s)
        while self._queue:
            jobs: list[PromptJob] = []
            while self._queue and len(jobs) < self.max_batch:
                job = self._queue.popleft()
                if not job.future.done():  # the request went away while queued
                    jobs.append(job)
            if not jobs:
                continue
            self.batch_sizes.append(len(jobs))
            try:
                results = await asyncio.to_thread(self.frontend.prompts.finish, [j.prompt for j in jobs])
            except asyncio.CancelledError:
                for j in jobs:
                    j.future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - finish() returns per-item errors; this is unexpected
                log.exception("prompt batch of %d failed", len(jobs))
                results = [exc] * len(jobs)
            for j, r in zip(jobs, results):
                if j.future.done():
                    continue
                if isinstance(r, BaseException):
                    j.future.set_exception(r)
                else:
                    j.future.set_result(r)
