"""``cosyserve client``: one TTS request over any protocol, saved as a wav.

The equivalent of the Triton runtime's ``client_http.py`` for every protocol cosyserve
speaks (KServe gRPC streaming/offline, KServe HTTP, OpenAI speech API), through the same
runners as ``cosyserve bench`` (:mod:`cosyserve.client.protocols`). The prompt is a
registered voice (``--voice``) or a reference recording with its transcript (sent as
KServe ``reference_wav`` at 16 kHz; for the OpenAI API it is first registered as a voice
through ``POST /v1/audio/voices`` and removed afterwards).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from .bench import analyze
from .protocols import (
    ClientError,
    GrpcStreamRunner,
    KServeOfflineRunner,
    OpenAIRunner,
    RequestSpec,
    check_combination,
    delete_openai_voices,
    parse_url,
    register_openai_voices,
    served_model_name,
)


@dataclass
class ClientOptions:
    """``cosyserve client`` options (see ``cosyserve client --help``)."""

    url: str
    text: str
    output: str
    protocol: str = "grpc"
    mode: str = "streaming"
    voice: str | None = None
    prompt_wav: str | None = None
    prompt_text: str | None = None
    seed: int | None = None
    api_key: str | None = None
    model_name: str | None = None  # None: the server's (served_model_name)
    timeout_s: float = 600.0


def run_client(o: ClientOptions) -> dict:
    """Send the request, write ``o.output`` (24 kHz 16-bit wav), return the numbers of
    :func:`cosyserve.client.bench.analyze` plus ``path`` and ``rtf``.

    Raises :class:`ClientError` for bad options or a failed request (the message carries
    the server's error).
    """
    import soundfile as sf

    check_combination(o.protocol, o.mode)
    scheme, addr = parse_url(o.url, o.protocol)
    if o.voice and (o.prompt_wav or o.prompt_text):
        raise ClientError("give either --voice or --prompt-wav with --prompt-text, not both")
    if not o.voice and (not o.prompt_wav or not o.prompt_text):
        raise ClientError("a voice is required: --voice ID, or --prompt-wav FILE with --prompt-text TRANSCRIPT")
    out = Path(o.output)
    if out.suffix.lower() != ".wav":
        raise ClientError(f"--output must be a .wav file, got {out.name!r}")
    spec = RequestSpec(uuid.uuid4().hex, o.text, seed=o.seed, voice=o.voice, item_id="client")
    created: list[str] = []
    base = f"{scheme}://{addr}"
    if not o.voice:
        path = Path(o.prompt_wav)
        if not path.is_file():
            raise ClientError(f"--prompt-wav {path} does not exist")
        if o.protocol == "openai":
            names, created = register_openai_voices(base, {"client": (path.read_bytes(), o.prompt_text)}, o.api_key)
            spec.voice = names["client"]
        else:
            from ..frontend.audio import load_prompt_wav

            spec.prompt_16k = load_prompt_wav(str(path), 16000)[0].numpy()
            spec.prompt_text = o.prompt_text
    model = o.model_name or served_model_name(o.protocol, scheme, addr, o.api_key)
    if o.protocol == "grpc" and o.mode == "streaming":
        runner = GrpcStreamRunner(addr, model, o.api_key, o.timeout_s)
    elif o.protocol in ("grpc", "http"):
        runner = KServeOfflineRunner(o.protocol, addr, model, o.api_key, o.timeout_s, ssl=scheme == "https")
    else:
        runner = OpenAIRunner(base, o.mode == "streaming", model, o.api_key, o.timeout_s)
    runner.keep_audio = True
    try:
        tr = runner.run(spec)
    finally:
        runner.close()
        if created:
            delete_openai_voices(base, created, o.api_key)
    res = analyze(tr)
    if not res["ok"]:
        raise ClientError(f"the request failed: {res['error']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(out), tr.waveform(), tr.sample_rate, subtype="PCM_16")
    res["path"] = str(out)
    res["rtf"] = res["total_s"] / res["audio_s"] if res["audio_s"] else float("inf")
    return res
