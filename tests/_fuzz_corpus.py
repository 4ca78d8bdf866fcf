"""A table-driven corpus of malformed requests for every route of ``cosyserve serve``.

Used by ``tests/test_reliability.py``. Every :class:`Case` is one request that a correct
server must refuse with a client error naming the offending field:

* HTTP (OpenAI speech, voice routes, KServe v2 HTTP JSON and binary): a 4xx status; the
  OpenAI routes name the field in ``error.param``, the KServe routes in ``error``'s text.
* gRPC (``ModelInfer``, and every ModelInfer case again on one ``ModelStreamInfer`` stream):
  ``INVALID_ARGUMENT`` / ``NOT_FOUND`` / ``RESOURCE_EXHAUSTED`` with the field in the details
  (on the stream: an in-band ``error_message`` ``"<CODE>: ..."``).

Cases are generated per route and per field from small tables (wrong JSON types, missing
fields, out-of-range values, broken encodings, corrupt / empty / huge / non-audio uploads,
0-length and 60 s prompts, path-like voice ids, oversized bodies), so adding a field to a
route means adding a row, not a test.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np

MODEL = "cosyvoice2"
#: the transcript of cosyserve/assets/prompts/zero_shot_prompt.wav
TRANSCRIPT = "希望你以后能够做的比我还好呦。"
MB = 1024 * 1024


@dataclass
class Case:
    """One malformed request and what the server must answer.

    ``route``: ``openai_speech``, ``voices``, ``kserve_http_json``, ``kserve_http_binary``,
    ``grpc_infer``, ``grpc_stream``. ``field``: the field / tensor the error must name
    (``None``: only the status is checked, e.g. gRPC's own message-size limit).
    ``expect``: accepted HTTP statuses, or accepted gRPC status code names.
    ``http``: ``{"method", "path", **httpx request kwargs}``; ``grpc``: a
    ``ModelInferRequest`` or raw (undecodable) message bytes.
    """

    route: str
    name: str
    field: str | None
    expect: tuple
    http: dict | None = None
    grpc: object = None
    tags: set = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"{self.route}:{self.name}"


# ---------------------------------------------------------------------------- audio helpers


def wav_bytes(seconds: float, sr: int = 16000, channels: int = 1, subtype: str = "PCM_16", fmt: str = "WAV",
              fill: float | None = None) -> bytes:
    """An encoded test signal (a 220 Hz tone at 0.3, or the constant ``fill``)."""
    import soundfile as sf

    n = int(round(seconds * sr))
    t = np.arange(n, dtype=np.float64) / sr
    x = (0.3 * np.sin(2 * math.pi * 220 * t)).astype(np.float32) if fill is None else np.full(n, fill, np.float32)
    x = np.repeat(x[:, None], channels, axis=1)
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def float_wav_with(value: float, seconds: float = 3.0, sr: int = 16000) -> bytes:
    """A float32 WAV whose middle sample is ``value`` (NaN / inf)."""
    import soundfile as sf

    n = int(seconds * sr)
    x = (0.1 * np.sin(np.arange(n) / 10)).astype(np.float32)
    x[n // 2] = value
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _with_rate(wav: bytes, rate: int) -> bytes:
    """A canonical WAV whose header claims another sample rate (the fmt chunk's field at byte 24)."""
    return wav[:24] + struct.pack("<I", rate) + wav[28:]


def tone16k(seconds: float) -> np.ndarray:
    n = int(seconds * 16000)
    return (0.3 * np.sin(2 * math.pi * 220 * np.arange(n) / 16000)).astype(np.float32)


# ---------------------------------------------------------------------------- OpenAI speech

SPEECH = "/v1/audio/speech"
GOOD_SPEECH = {"model": MODEL, "input": "你好。", "voice": "default", "response_format": "pcm", "seed": 1}

#: (field, [(label, bad value, expected status)]) -- wrong JSON types and out-of-range values
SPEECH_FIELD_VALUES = {
    "model": [("int", 1, 400), ("float", 1.5, 400), ("bool", True, 400), ("null", None, 400), ("list", [], 400),
              ("object", {}, 400), ("unknown", "nope", 404), ("empty", "", 404), ("path", "../cosyvoice2", 404)],
    "input": [("int", 12, 400), ("float", 1.5, 400), ("bool", True, 400), ("null", None, 400), ("list", ["a"], 400),
              ("object", {"text": "a"}, 400), ("empty", "", 400), ("blank", "   \n\t", 400),
              ("punctuation_only", "。。。！？", 400), ("over_limit", "字" * 4097, 400),
              ("1MB", "a" * MB, 400), ("lone_surrogate", "\ud800你好", 400), ("nul_only", "\x00\x00", 400)],
    "voice": [("int", 1, 400), ("float", 2.5, 400), ("bool", False, 400), ("null", None, 400), ("list", ["default"], 400),
              ("object_no_id", {}, 400), ("object_int_id", {"id": 1}, 400), ("object_extra", {"id": "default", "x": 1}, 400),
              ("unknown", "nobody", 400), ("dotdot", "../../x", 400), ("dotdot_obj", {"id": "../../x"}, 400),
              ("abs_path", "/etc/passwd", 400), ("slash", "a/b", 400), ("backslash", "a\\b", 400),
              ("hidden", ".default", 400), ("tmp_suffix", "x.tmp", 400), ("too_long", "a" * 65, 400),
              ("empty", "", 400), ("space", "de fault", 400), ("nul", "default\x00", 400), ("non_ascii", "声音", 400),
              ("percent", "%2e%2e%2fx", 400)],
    "response_format": [("int", 1, 400), ("null", None, 400), ("list", ["wav"], 400), ("unknown", "ogg", 400),
                        ("empty", "", 400), ("upper", "WAV", 400), ("unsupported_aac", "aac", 400)],
    "speed": [("string", "fast", 400), ("null", None, 400), ("list", [1], 400), ("object", {}, 400),
              ("negative", -1, 400), ("zero", 0, 400), ("too_slow", 0.1, 400), ("too_fast", 5, 400),
              ("huge", 1e308, 400), ("nan_string", "nan", 400), ("inf_string", "inf", 400)],
    "stream_format": [("int", 1, 400), ("unknown", "chunks", 400), ("null", None, 400), ("list", ["sse"], 400)],
    "instructions": [("int", 1, 400), ("list", ["x"], 400), ("unsupported", "speak happily", 400)],
    "seed": [("string", "abc", 400), ("float", 1.5, 400), ("list", [1], 400), ("object", {}, 400),
             ("too_big", 2 ** 63, 400), ("huge", 2 ** 100, 400), ("very_negative", -(2 ** 63) - 1, 400),
             ("bool", True, 400)],
    "stream": [("string", "maybe", 400), ("int", 2, 400), ("list", [], 400), ("object", {}, 400)],
}


def _raw_json(s: str | bytes) -> dict:
    return {"content": s.encode() if isinstance(s, str) else s, "headers": {"content-type": "application/json"}}


def _oversized_stream(total: int, piece: int = 256 * 1024):
    """A request body sent with chunked transfer encoding (no Content-Length)."""
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        sent += n
        yield b" " * n


def openai_speech_cases(max_body: int) -> list[Case]:
    out = []
    for f in ("model", "input", "voice"):
        body = {k: v for k, v in GOOD_SPEECH.items() if k != f}
        out.append(Case("openai_speech", f"missing_{f}", f, (400,), {"method": "POST", "path": SPEECH, "json": body}))
    for f, rows in SPEECH_FIELD_VALUES.items():
        for label, value, status in rows:
            body = {**GOOD_SPEECH, f: value}
            out.append(Case("openai_speech", f"{f}_{label}", f, (status,),
                            {"method": "POST", "path": SPEECH, "json": body}))
    for name in ("bogus", "voice_id", "format", ""):
        out.append(Case("openai_speech", f"extra_field_{name or 'empty_key'}", name or None, (400,),
                        {"method": "POST", "path": SPEECH, "json": {**GOOD_SPEECH, name: 1}}))
    good = json.dumps(GOOD_SPEECH)
    raw = [
        ("speed_NaN_literal", good.replace('"seed": 1', '"seed": 1, "speed": NaN'), "speed"),
        ("speed_Infinity_literal", good.replace('"seed": 1', '"seed": 1, "speed": Infinity'), "speed"),
        ("speed_neg_Infinity_literal", good.replace('"seed": 1', '"seed": 1, "speed": -Infinity'), "speed"),
        ("not_json", "{not json", "body"),
        ("truncated_json", good[:-5], "body"),
        ("json_array", "[]", "body"),
        ("json_string", '"hello"', "body"),
        ("json_null", "null", "body"),
        ("json_number", "42", "body"),
        ("empty_body", "", "body"),
        ("invalid_utf8", json.dumps(GOOD_SPEECH, ensure_ascii=False).encode().replace("你好".encode(), b"\xff\xfe\xc3"),
         "body"),
        ("deeply_nested", '{"model": ' + "[" * 100000 + "]" * 100000 + "}", "body"),
        ("trailing_garbage", good + "garbage", "body"),
    ]
    for name, content, f in raw:
        out.append(Case("openai_speech", name, f, (400,), {"method": "POST", "path": SPEECH, **_raw_json(content)}))
    out.append(Case("openai_speech", "text_plain_content_type", "body", (400, 415),
                    {"method": "POST", "path": SPEECH, "content": good.encode(), "headers": {"content-type": "text/plain"}}))
    out.append(Case("openai_speech", "oversized_content_length", "body", (413,),
                    {"method": "POST", "path": SPEECH, **_raw_json(b" " * (max_body + 1))}))
    out.append(Case("openai_speech", "oversized_chunked", "body", (413,),
                    {"method": "POST", "path": SPEECH, "content": ("stream", max_body + MB),
                     "headers": {"content-type": "application/json"}}))
    return out


# ---------------------------------------------------------------------------- voices

VOICES = "/v1/audio/voices"


def _voice_post(files: dict | None, data: dict | None, **kw) -> dict:
    d = {"method": "POST", "path": VOICES}
    if files is not None:
        d["files"] = files
    if data is not None:
        d["data"] = data
    d.update(kw)
    return d


def voice_cases(prompt: bytes, max_body: int) -> list[Case]:
    ok_files = {"audio_sample": ("p.wav", prompt, "audio/wav")}
    ok_data = {"name": "fuzzvoice", "ref_text": TRANSCRIPT}
    out = [
        Case("voices", "missing_audio_sample", "audio_sample", (400,), _voice_post(None, ok_data)),
        Case("voices", "missing_name", "name", (400,), _voice_post(ok_files, {"ref_text": TRANSCRIPT})),
        Case("voices", "missing_ref_text", "ref_text", (400,), _voice_post(ok_files, {"name": "fuzzvoice"})),
        Case("voices", "json_instead_of_multipart", "audio_sample", (400,),
             {"method": "POST", "path": VOICES, "json": ok_data}),
        Case("voices", "audio_sample_as_text_field", "audio_sample", (400,),
             _voice_post(None, {**ok_data, "audio_sample": "not a file"})),
    ]
    for label, name in [("dotdot", "../../x"), ("slash", "a/b"), ("empty", ""), ("hidden", ".x"), ("tmp", "x.tmp"),
                        ("too_long", "v" * 65), ("non_ascii", "声音"), ("space", "a b"), ("nul", "a\x00b"),
                        ("abs", "/tmp/x"), ("backslash", "..\\x")]:
        out.append(Case("voices", f"name_{label}", "name", (400,), _voice_post(ok_files, {**ok_data, "name": name})))
    out.append(Case("voices", "name_exists", "name", (409,), _voice_post(ok_files, {**ok_data, "name": "default"})))
    for label, text in [("empty", ""), ("blank", "   "), ("1MB", "字" * (MB // 3))]:
        out.append(Case("voices", f"ref_text_{label}", "ref_text", (400,),
                        _voice_post(ok_files, {**ok_data, "ref_text": text})))
    rng = np.random.default_rng(0)
    junk = {
        "empty": b"",
        "text": b"this is not audio at all\n" * 40,
        "png": b"\x89PNG\r\n\x1a\n" + bytes(rng.integers(0, 256, 4000, dtype=np.uint8)),
        "random_100k": bytes(rng.integers(0, 256, 100_000, dtype=np.uint8)),
        "riff_header_only": b"RIFF\x24\x00\x00\x00WAVE",
        "wav_truncated": wav_bytes(3.0)[:60],
        "wav_header_no_data": wav_bytes(0.0),
        "wav_zero_rate": _with_rate(wav_bytes(2.0), 0),
        "mp3_junk": b"ID3\x03\x00\x00\x00\x00\x00\x00" + bytes(rng.integers(0, 256, 5000, dtype=np.uint8)),
        "ogg_junk": b"OggS" + bytes(rng.integers(0, 256, 5000, dtype=np.uint8)),
        "flac_junk": b"fLaC" + bytes(rng.integers(0, 256, 5000, dtype=np.uint8)),
        "too_short_0.5s": wav_bytes(0.5),
        "too_long_60s": wav_bytes(60.0),
        "sample_rate_8k": wav_bytes(3.0, sr=8000),
        "sample_rate_500": _with_rate(wav_bytes(3.0), 500),
        "nan_samples": float_wav_with(float("nan")),
        "inf_samples": float_wav_with(float("inf")),
        "silence_zero_length_flac": wav_bytes(0.0, fmt="FLAC"),
    }
    for label, data in junk.items():
        out.append(Case("voices", f"audio_{label}", "audio_sample", (400,),
                        _voice_post({"audio_sample": ("x.wav", data, "audio/wav")}, ok_data)))
    out.append(Case("voices", "audio_over_limit", "body", (413,),
                    _voice_post({"audio_sample": ("big.wav", b"\0" * (max_body + 1024), "audio/wav")}, ok_data)))
    boundary = "fuzzboundary"
    out += [
        Case("voices", "multipart_no_boundary", "body", (400,),
             {"method": "POST", "path": VOICES, "content": b"--x\r\n\r\n", "headers": {"content-type": "multipart/form-data"}}),
        Case("voices", "multipart_wrong_boundary", "body", (400,),
             {"method": "POST", "path": VOICES, "content": b"--other\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nx\r\n--other--\r\n",
              "headers": {"content-type": f"multipart/form-data; boundary={boundary}"}}),
        Case("voices", "multipart_truncated", "audio_sample", (400,),
             {"method": "POST", "path": VOICES,
              "content": f"--{boundary}\r\nContent-Disposition: form-data; name=\"audio_sample\"; filename=\"a.wav\"\r\n"
                         f"Content-Type: audio/wav\r\n\r\nRIFF".encode(),
              "headers": {"content-type": f"multipart/form-data; boundary={boundary}"}}),
        Case("voices", "oversized_chunked", "body", (413,),
             {"method": "POST", "path": VOICES, "content": ("stream", max_body + MB),
              "headers": {"content-type": f"multipart/form-data; boundary={boundary}"}}),
    ]
    # GET answers 404 for any id it does not hold; DELETE refuses an invalid id with 400; an
    # id with an encoded "/" leaves the route (404, no field)
    for label, vid, field_name in [("unknown", "nobody", "name"), ("dotdot_encoded", "..%2F..%2Fx", None),
                                   ("invalid_chars", "a%20b", "name"), ("too_long", "v" * 65, "name"),
                                   ("dotdot_plain", "..", None)]:
        out.append(Case("voices", f"get_{label}", field_name, (400, 404), {"method": "GET", "path": f"{VOICES}/{vid}"}))
        out.append(Case("voices", f"delete_{label}", field_name, (400, 404),
                        {"method": "DELETE", "path": f"{VOICES}/{vid}"}))
    return out


# ---------------------------------------------------------------------------- KServe v2 HTTP

INFER = f"/v2/models/{MODEL}/infer"
TT = {"name": "target_text", "shape": [1, 1], "datatype": "BYTES", "data": ["你好。"]}
REF_TEXT = {"name": "reference_text", "shape": [1, 1], "datatype": "BYTES", "data": [TRANSCRIPT]}


def _ref_wav(samples, shape=None, datatype="FP32"):
    samples = list(samples)
    return {"name": "reference_wav", "shape": shape or [1, len(samples)], "datatype": datatype, "data": samples}


def kserve_json_cases(max_body: int) -> list[Case]:
    def post(doc, path=INFER):
        return {"method": "POST", "path": path, "json": doc}

    three_s = np.round(tone16k(3.0), 4).tolist()
    cases = [
        # (name, document, field)
        ("empty_object", {}, "inputs"),
        ("inputs_object", {"inputs": {"target_text": "x"}}, "inputs"),
        ("inputs_string", {"inputs": "x"}, "inputs"),
        ("inputs_null", {"inputs": None}, "inputs"),
        ("inputs_empty", {"inputs": []}, "target_text"),
        ("input_int", {"inputs": [1]}, "inputs"),
        ("input_string", {"inputs": ["target_text"]}, "inputs"),
        ("input_null", {"inputs": [None]}, "inputs"),
        ("input_missing_name", {"inputs": [{k: v for k, v in TT.items() if k != "name"}]}, "inputs"),
        ("input_missing_datatype", {"inputs": [{k: v for k, v in TT.items() if k != "datatype"}]}, "inputs"),
        ("input_missing_shape", {"inputs": [{k: v for k, v in TT.items() if k != "shape"}]}, "inputs"),
        ("input_missing_data", {"inputs": [{k: v for k, v in TT.items() if k != "data"}]}, "target_text"),
        ("name_not_string", {"inputs": [{**TT, "name": 5}, TT]}, "5"),
        ("unknown_tensor", {"inputs": [TT, {**TT, "name": "speaker"}]}, "speaker"),
        ("duplicate_tensor", {"inputs": [TT, TT]}, "target_text"),
        ("shape_string", {"inputs": [{**TT, "shape": "1x1"}]}, "target_text"),
        ("shape_null", {"inputs": [{**TT, "shape": None}]}, "target_text"),
        ("shape_of_strings", {"inputs": [{**TT, "shape": ["a", "b"]}]}, "target_text"),
        ("shape_negative", {"inputs": [{**TT, "shape": [-1, 1]}]}, "target_text"),
        ("shape_float", {"inputs": [{**TT, "shape": [1.5, 1]}]}, "target_text"),
        ("shape_huge", {"inputs": [{**TT, "shape": [1, 2 ** 62]}]}, "target_text"),
        ("batch_of_two", {"inputs": [{**TT, "shape": [2, 1], "data": ["a", "b"]}]}, "target_text"),
        ("count_mismatch", {"inputs": [{**TT, "shape": [1, 2]}]}, "target_text"),
        ("datatype_unknown", {"inputs": [{**TT, "datatype": "FP8"}]}, "target_text"),
        ("datatype_wrong", {"inputs": [{**TT, "datatype": "FP32", "data": [1.0]}]}, "target_text"),
        ("datatype_int", {"inputs": [{**TT, "datatype": 7}]}, "target_text"),
        ("bytes_data_int", {"inputs": [{**TT, "data": [5]}]}, "target_text"),
        ("bytes_data_huge_int", {"inputs": [{**TT, "data": [10 ** 12]}]}, "target_text"),
        ("bytes_data_float", {"inputs": [{**TT, "data": [1.5]}]}, "target_text"),
        ("bytes_data_object", {"inputs": [{**TT, "data": [{"a": 1}]}]}, "target_text"),
        ("bytes_data_null", {"inputs": [{**TT, "data": [None]}]}, "target_text"),
        ("bytes_data_scalar", {"inputs": [{**TT, "data": "你好"}]}, "target_text"),
        ("input_parameters_int", {"inputs": [{**TT, "parameters": 5}]}, "target_text"),
        ("binary_size_without_binary", {"inputs": [{**TT, "parameters": {"binary_data_size": 10}}]}, "target_text"),
        ("binary_size_string", {"inputs": [{**TT, "parameters": {"binary_data_size": "abc"}}]}, "target_text"),
        ("binary_size_negative", {"inputs": [{**TT, "parameters": {"binary_data_size": -4}}]}, "target_text"),
        ("target_text_empty", {"inputs": [{**TT, "data": [""]}]}, "target_text"),
        ("target_text_blank", {"inputs": [{**TT, "data": ["  \t "]}]}, "target_text"),
        ("target_text_punctuation", {"inputs": [{**TT, "data": ["。。？！"]}]}, "target_text"),
        ("target_text_over_limit", {"inputs": [{**TT, "data": ["字" * 4097]}]}, "target_text"),
        ("target_text_1MB", {"inputs": [{**TT, "data": ["a" * MB]}]}, "target_text"),
        ("target_text_lone_surrogate", {"inputs": [{**TT, "data": ["\udcff你好"]}]}, "target_text"),
        ("voice_unknown", {"inputs": [TT, {**TT, "name": "voice", "data": ["nobody"]}]}, "voice"),
        ("voice_dotdot", {"inputs": [TT, {**TT, "name": "voice", "data": ["../../x"]}]}, "voice"),
        ("voice_empty", {"inputs": [TT, {**TT, "name": "voice", "data": [""]}]}, "voice"),
        ("voice_and_reference", {"inputs": [TT, {**TT, "name": "voice", "data": ["default"]}, _ref_wav(three_s),
                                            REF_TEXT]}, "voice"),
        ("ref_wav_int32", {"inputs": [TT, _ref_wav([1, 2, 3, 4], datatype="INT32"), REF_TEXT]}, "reference_wav"),
        ("ref_wav_3d", {"inputs": [TT, _ref_wav([0.1] * 4, shape=[1, 2, 2]), REF_TEXT]}, "reference_wav"),
        ("ref_wav_count", {"inputs": [TT, _ref_wav([0.1, 0.2], shape=[1, 3]), REF_TEXT]}, "reference_wav"),
        ("ref_wav_strings", {"inputs": [TT, _ref_wav(["a", "b"]), REF_TEXT]}, "reference_wav"),
        ("ref_wav_zero_length", {"inputs": [TT, _ref_wav([], shape=[1, 0]), REF_TEXT]}, "reference_wav"),
        ("ref_wav_too_short", {"inputs": [TT, _ref_wav([0.1] * 800), REF_TEXT]}, "reference_wav"),
        ("ref_wav_60s", {"inputs": [TT, _ref_wav(np.round(tone16k(60.0), 2).tolist()), REF_TEXT]}, "reference_wav"),
        ("ref_wav_no_text", {"inputs": [TT, _ref_wav(three_s)]}, "reference_text"),
        ("ref_text_int", {"inputs": [TT, _ref_wav(three_s), {**REF_TEXT, "data": [5]}]}, "reference_text"),
        ("ref_text_blank", {"inputs": [TT, _ref_wav(three_s), {**REF_TEXT, "data": ["  "]}]}, "reference_text"),
        ("ref_text_without_wav", {"inputs": [TT, REF_TEXT]}, "reference_wav"),
        ("ref_len_zero", {"inputs": [TT, _ref_wav(three_s), REF_TEXT, {"name": "reference_wav_len", "shape": [1, 1],
                                                                      "datatype": "INT32", "data": [0]}]},
         "reference_wav_len"),
        ("ref_len_negative", {"inputs": [TT, _ref_wav(three_s), REF_TEXT, {"name": "reference_wav_len", "shape": [1, 1],
                                                                          "datatype": "INT32", "data": [-5]}]},
         "reference_wav_len"),
        ("ref_len_too_big", {"inputs": [TT, _ref_wav(three_s), REF_TEXT, {"name": "reference_wav_len", "shape": [1, 1],
                                                                         "datatype": "INT32", "data": [10 ** 6]}]},
         "reference_wav_len"),
        ("ref_len_overflow", {"inputs": [TT, _ref_wav(three_s), REF_TEXT, {"name": "reference_wav_len", "shape": [1, 1],
                                                                          "datatype": "INT32", "data": [2 ** 40]}]},
         "reference_wav_len"),
        ("ref_len_fp32", {"inputs": [TT, _ref_wav(three_s), REF_TEXT, {"name": "reference_wav_len", "shape": [1, 1],
                                                                      "datatype": "FP32", "data": [100.0]}]},
         "reference_wav_len"),
        ("ref_len_two_values", {"inputs": [TT, _ref_wav(three_s), REF_TEXT, {"name": "reference_wav_len",
                                                                            "shape": [1, 2], "datatype": "INT32",
                                                                            "data": [1, 2]}]}, "reference_wav_len"),
        ("ref_len_without_wav", {"inputs": [TT, {"name": "reference_wav_len", "shape": [1, 1], "datatype": "INT32",
                                                 "data": [100]}]}, "reference_wav"),
        ("param_seed_string", {"inputs": [TT], "parameters": {"seed": "abc"}}, "seed"),
        ("param_seed_list", {"inputs": [TT], "parameters": {"seed": [1]}}, "seed"),
        ("param_seed_huge", {"inputs": [TT], "parameters": {"seed": 2 ** 70}}, "seed"),
        ("param_seed_below_int64", {"inputs": [TT], "parameters": {"seed": -(2 ** 63) - 1}}, "seed"),
        ("param_seed_bool", {"inputs": [TT], "parameters": {"seed": True}}, "seed"),
        ("param_seed_fraction", {"inputs": [TT], "parameters": {"seed": 1.5}}, "seed"),
        ("param_chunk_policy", {"inputs": [TT], "parameters": {"chunk_policy": "bogus"}}, "chunk_policy"),
        ("parameters_int", {"inputs": [TT], "parameters": 5}, "parameters"),
        ("parameters_list", {"inputs": [TT], "parameters": ["seed"]}, "parameters"),
        ("outputs_unknown", {"inputs": [TT], "outputs": [{"name": "audio"}]}, "outputs"),
        ("outputs_string", {"inputs": [TT], "outputs": "waveform"}, "outputs"),
        ("outputs_of_ints", {"inputs": [TT], "outputs": [1]}, "outputs"),
    ]
    out = [Case("kserve_http_json", name, f, (400,), post(doc)) for name, doc, f in cases]
    out += [
        Case("kserve_http_json", "ref_wav_nan", "reference_wav", (400,),
             {"method": "POST", "path": INFER, **_raw_json(json.dumps({"inputs": [TT, REF_TEXT]})[:-2]
                                                           + ', {"name": "reference_wav", "shape": [1, 3], '
                                                             '"datatype": "FP32", "data": [0.1, NaN, 0.2]}]}')}),
        Case("kserve_http_json", "ref_wav_infinity", "reference_wav", (400,),
             {"method": "POST", "path": INFER, **_raw_json(json.dumps({"inputs": [TT, REF_TEXT]})[:-2]
                                                           + ', {"name": "reference_wav", "shape": [1, 3], '
                                                             '"datatype": "FP32", "data": [0.1, Infinity, 0.2]}]}')}),
        Case("kserve_http_json", "not_json", "body", (400,), {"method": "POST", "path": INFER, **_raw_json("{oops")}),
        Case("kserve_http_json", "json_array", "inputs", (400,), {"method": "POST", "path": INFER, **_raw_json("[]")}),
        Case("kserve_http_json", "empty_body", "body", (400,), {"method": "POST", "path": INFER, **_raw_json("")}),
        Case("kserve_http_json", "invalid_utf8", "body", (400,),
             {"method": "POST", "path": INFER,
              **_raw_json(json.dumps({"inputs": [TT]}, ensure_ascii=False).encode().replace("你".encode(), b"\xff\xfe"))}),
        Case("kserve_http_json", "deeply_nested", "body", (400,),
             {"method": "POST", "path": INFER, **_raw_json('{"inputs": ' + "[" * 100000 + "]" * 100000 + "}")}),
        Case("kserve_http_json", "unknown_model", "model", (404,),
             {"method": "POST", "path": "/v2/models/other/infer", "json": {"inputs": [TT]}}),
        Case("kserve_http_json", "unknown_version", "version", (404,),
             {"method": "POST", "path": f"/v2/models/{MODEL}/versions/7/infer", "json": {"inputs": [TT]}}),
        Case("kserve_http_json", "oversized_content_length", "body", (413,),
             {"method": "POST", "path": INFER, **_raw_json(b" " * (max_body + 1))}),
        Case("kserve_http_json", "oversized_chunked", "body", (413,),
             {"method": "POST", "path": INFER, "content": ("stream", max_body + MB),
              "headers": {"content-type": "application/json"}}),
    ]
    return out


def bytes_tensor(*items: bytes) -> bytes:
    """Triton's BYTES serialisation: a 4-byte little-endian length before each element."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def binary_body(inputs: list[tuple[dict, bytes]], extra: dict | None = None, header_len_delta: int = 0,
                header_override: bytes | None = None, header_len: str | None = None) -> dict:
    """A KServe v2 binary-extension request: JSON header + concatenated tensor bytes."""
    head_doc = {"inputs": [], **(extra or {})}
    blob = b""
    for meta, raw in inputs:
        m = dict(meta)
        m.setdefault("parameters", {})
        m["parameters"] = {"binary_data_size": len(raw), **m["parameters"]}
        head_doc["inputs"].append(m)
        blob += raw
    head = header_override if header_override is not None else json.dumps(head_doc).encode()
    n = header_len if header_len is not None else str(len(head) + header_len_delta)
    return {"method": "POST", "path": INFER, "content": head + blob,
            "headers": {"Inference-Header-Content-Length": n, "content-type": "application/octet-stream"}}


def kserve_binary_cases(max_body: int) -> list[Case]:
    tt = {"name": "target_text", "shape": [1, 1], "datatype": "BYTES"}
    good_tt = (tt, bytes_tensor("你好。".encode()))
    rt = ({"name": "reference_text", "shape": [1, 1], "datatype": "BYTES"}, bytes_tensor(TRANSCRIPT.encode()))

    def wav(x: np.ndarray, shape=None):
        return ({"name": "reference_wav", "shape": shape or [1, int(x.size)], "datatype": "FP32"},
                np.asarray(x, "<f4").tobytes())

    nan = tone16k(3.0)
    nan[100] = np.nan
    inf = tone16k(3.0)
    inf[7] = -np.inf
    rows = [
        ("header_len_not_int", binary_body([good_tt], header_len="abc"), "Inference-Header-Content-Length"),
        ("header_len_negative", binary_body([good_tt], header_len="-1"), "Inference-Header-Content-Length"),
        ("header_len_beyond_body", binary_body([good_tt], header_len="999999"), "Inference-Header-Content-Length"),
        ("header_len_too_short", binary_body([good_tt], header_len_delta=-3), "body"),
        ("header_not_json", binary_body([good_tt], header_override=b"not json at all"), "body"),
        ("header_invalid_utf8", binary_body([good_tt], header_override=b'{"inputs": ["\xff\xfe"]}'), "body"),
        ("binary_size_beyond_payload", binary_body([({**tt, "parameters": {"binary_data_size": 10 ** 6}},
                                                     bytes_tensor(b"hi"))]), "target_text"),
        ("binary_size_string", binary_body([({**tt, "parameters": {"binary_data_size": "x"}}, bytes_tensor(b"hi"))]),
         "target_text"),
        ("trailing_payload", {**binary_body([good_tt]), "content": binary_body([good_tt])["content"] + b"junk"},
         "binary"),
        ("bytes_truncated_length", binary_body([(tt, b"\x05\x00")]), "target_text"),
        ("bytes_element_truncated", binary_body([(tt, struct.pack("<I", 100) + b"abc")]), "target_text"),
        ("bytes_trailing", binary_body([(tt, bytes_tensor(b"hi") + b"zz")]), "target_text"),
        ("bytes_two_elements", binary_body([(tt, bytes_tensor(b"a", b"b"))]), "target_text"),
        ("bytes_invalid_utf8", binary_body([(tt, bytes_tensor(b"\xff\xfe\xfd"))]), "target_text"),
        ("bytes_empty_text", binary_body([(tt, bytes_tensor(b""))]), "target_text"),
        ("bytes_1MB_text", binary_body([(tt, bytes_tensor(b"a" * MB))]), "target_text"),
        ("fp32_size_not_multiple", binary_body([good_tt, ({"name": "reference_wav", "shape": [1, 3], "datatype": "FP32"},
                                                          b"\0" * 7), rt]), "reference_wav"),
        ("fp32_unknown_dtype", binary_body([good_tt, ({"name": "reference_wav", "shape": [1, 2], "datatype": "FP8"},
                                                      b"\0\0"), rt]), "reference_wav"),
        ("ref_wav_nan", binary_body([good_tt, wav(nan), rt]), "reference_wav"),
        ("ref_wav_inf", binary_body([good_tt, wav(inf), rt]), "reference_wav"),
        ("ref_wav_zero_length", binary_body([good_tt, wav(np.zeros(0, np.float32)), rt]), "reference_wav"),
        ("ref_wav_60s", binary_body([good_tt, wav(tone16k(60.0)), rt]), "reference_wav"),
        ("ref_wav_silence_0.2s", binary_body([good_tt, wav(np.zeros(3200, np.float32)), rt]), "reference_wav"),
        ("ref_len_raw_wrong_size", binary_body([good_tt, wav(tone16k(3.0)), rt,
                                                ({"name": "reference_wav_len", "shape": [1, 1], "datatype": "INT32"},
                                                 b"\1\0")]), "reference_wav_len"),
        ("ref_text_invalid_utf8", binary_body([good_tt, wav(tone16k(3.0)),
                                               (rt[0], bytes_tensor(b"\xc3\x28"))]), "reference_text"),
        ("voice_invalid_utf8", binary_body([good_tt, ({"name": "voice", "shape": [1, 1], "datatype": "BYTES"},
                                                      bytes_tensor(b"\xe2\x82"))]), "voice"),
        ("oversized", {**binary_body([good_tt]), "content": binary_body([(tt, bytes_tensor(b"a" * (max_body + 10)))])[
            "content"]}, "body"),
    ]
    out = []
    for name, req, f in rows:
        out.append(Case("kserve_http_binary", name, f, (413,) if name == "oversized" else (400,), req))
    return out


# ---------------------------------------------------------------------------- gRPC


def grpc_request(inputs: list[tuple[str, str, list[int], object]], *, raw: bool = True, model: str = MODEL,
                 version: str = "", params: dict | None = None, outputs: tuple[str, ...] = (), rid: str = "",
                 extra_raw: list[bytes] | None = None):
    """A ``ModelInferRequest``: ``inputs`` are ``(name, datatype, shape, value)``; ``value`` is
    raw bytes (``raw``) or a list for the typed ``contents``."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, model_version=version, id=rid)
    for name, dt, shape, value in inputs:
        t = req.inputs.add(name=name, datatype=dt, shape=shape)
        if raw:
            req.raw_input_contents.append(value)
        else:
            field_name = {"BYTES": "bytes_contents", "FP32": "fp32_contents", "INT32": "int_contents",
                          "INT64": "int64_contents", "BOOL": "bool_contents"}[dt]
            getattr(t.contents, field_name).extend(value)
    for r in extra_raw or []:
        req.raw_input_contents.append(r)
    for k, v in (params or {}).items():
        p = req.parameters[k]
        if isinstance(v, tuple) and v[0] == "uint64":
            p.uint64_param = v[1]
        elif isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = v
        elif isinstance(v, float):
            p.double_param = v
        else:
            p.string_param = v
    for o in outputs:
        req.outputs.add(name=o)
    return req


def grpc_cases(max_body: int) -> list[Case]:
    def tt(text: bytes = "你好。".encode()):
        return ("target_text", "BYTES", [1, 1], bytes_tensor(text))

    def wav(x: np.ndarray, shape=None):
        return ("reference_wav", "FP32", shape or [1, int(x.size)], np.asarray(x, "<f4").tobytes())

    rt = ("reference_text", "BYTES", [1, 1], bytes_tensor(TRANSCRIPT.encode()))
    nan = tone16k(3.0)
    nan[5] = np.nan
    three = tone16k(3.0)
    IA, NF = ("INVALID_ARGUMENT",), ("NOT_FOUND",)
    rows = [
        ("no_inputs", grpc_request([]), "target_text", IA),
        ("unknown_tensor", grpc_request([tt(), ("speaker", "BYTES", [1, 1], bytes_tensor(b"x"))]), "speaker", IA),
        ("duplicate_tensor", grpc_request([tt(), tt()]), "target_text", IA),
        ("target_text_fp32", grpc_request([("target_text", "FP32", [1, 1], b"\0\0\0\0")]), "target_text", IA),
        ("target_text_typed_fp32", grpc_request([("target_text", "FP32", [1, 1], [1.0])], raw=False), "target_text", IA),
        ("target_text_invalid_utf8", grpc_request([tt(b"\xff\xfe")]), "target_text", IA),
        ("target_text_empty", grpc_request([tt(b"")]), "target_text", IA),
        ("target_text_blank", grpc_request([tt(b"   ")]), "target_text", IA),
        ("target_text_punctuation", grpc_request([tt("。。！".encode())]), "target_text", IA),
        ("target_text_over_limit", grpc_request([tt(("字" * 4097).encode())]), "target_text", IA),
        ("target_text_1MB", grpc_request([tt(b"a" * MB)]), "target_text", IA),
        ("shape_batch_two", grpc_request([("target_text", "BYTES", [2, 1], bytes_tensor(b"a", b"b"))]), "target_text", IA),
        ("shape_negative", grpc_request([("target_text", "BYTES", [-1, 1], bytes_tensor(b"a"))]), "target_text", IA),
        ("shape_huge", grpc_request([("target_text", "BYTES", [1, 2 ** 62], bytes_tensor(b"a"))]), "target_text", IA),
        ("shape_huge_typed", grpc_request([("target_text", "BYTES", [1, 2 ** 62], [b"a"])], raw=False), "target_text", IA),
        ("typed_count_mismatch", grpc_request([("target_text", "BYTES", [1, 2], [b"a"])], raw=False), "target_text", IA),
        ("raw_count_mismatch", grpc_request([tt()], extra_raw=[b"x"]), "inputs", IA),
        ("raw_bytes_truncated", grpc_request([("target_text", "BYTES", [1, 1], b"\x09\x00\x00\x00ab")]),
         "target_text", IA),
        ("raw_bytes_trailing", grpc_request([("target_text", "BYTES", [1, 1], bytes_tensor(b"ab") + b"!")]),
         "target_text", IA),
        ("datatype_unknown", grpc_request([("target_text", "FP8", [1, 1], b"\0")]), "target_text", IA),
        ("datatype_empty", grpc_request([("target_text", "", [1, 1], b"\0")]), "target_text", IA),
        ("datatype_fp16", grpc_request([("target_text", "FP16", [1, 1], b"\0\0")]), "target_text", IA),
        ("ref_wav_int32", grpc_request([tt(), ("reference_wav", "INT32", [1, 4], b"\0" * 16), rt]), "reference_wav", IA),
        ("ref_wav_size", grpc_request([tt(), ("reference_wav", "FP32", [1, 4], b"\0" * 15), rt]), "reference_wav", IA),
        ("ref_wav_nan", grpc_request([tt(), wav(nan), rt]), "reference_wav", IA),
        ("ref_wav_zero_length", grpc_request([tt(), wav(np.zeros(0, np.float32)), rt]), "reference_wav", IA),
        ("ref_wav_too_short", grpc_request([tt(), wav(three[:1600]), rt]), "reference_wav", IA),
        ("ref_wav_60s", grpc_request([tt(), wav(tone16k(60.0)), rt]), "reference_wav", IA),
        ("ref_wav_3d", grpc_request([tt(), wav(three[:8], shape=[1, 2, 4]), rt]), "reference_wav", IA),
        ("ref_wav_no_text", grpc_request([tt(), wav(three)]), "reference_text", IA),
        ("ref_text_invalid_utf8", grpc_request([tt(), wav(three), ("reference_text", "BYTES", [1, 1],
                                                                   bytes_tensor(b"\x80abc"))]), "reference_text", IA),
        ("ref_len_zero", grpc_request([tt(), wav(three), rt, ("reference_wav_len", "INT32", [1, 1],
                                                              np.int32(0).tobytes())]), "reference_wav_len", IA),
        ("ref_len_too_big", grpc_request([tt(), wav(three), rt, ("reference_wav_len", "INT32", [1, 1],
                                                                 np.int32(10 ** 8).tobytes())]), "reference_wav_len", IA),
        ("ref_len_fp32", grpc_request([tt(), wav(three), rt, ("reference_wav_len", "FP32", [1, 1],
                                                              np.float32(5).tobytes())]), "reference_wav_len", IA),
        ("ref_text_without_wav", grpc_request([tt(), rt]), "reference_wav", IA),
        ("voice_unknown", grpc_request([tt(), ("voice", "BYTES", [1, 1], bytes_tensor(b"nobody"))]), "voice", NF),
        ("voice_dotdot", grpc_request([tt(), ("voice", "BYTES", [1, 1], bytes_tensor(b"../../x"))]), "voice",
         IA + NF),
        ("voice_and_reference", grpc_request([tt(), ("voice", "BYTES", [1, 1], bytes_tensor(b"default")),
                                              wav(three), rt]), "voice", IA),
        ("param_seed_string", grpc_request([tt()], params={"seed": "abc"}), "seed", IA),
        ("param_seed_uint64_max", grpc_request([tt()], params={"seed": ("uint64", 2 ** 64 - 1)}), "seed", IA),
        ("param_seed_bool", grpc_request([tt()], params={"seed": True}), "seed", IA),
        ("param_seed_float", grpc_request([tt()], params={"seed": 1.5}), "seed", IA),
        ("param_chunk_policy", grpc_request([tt()], params={"chunk_policy": "bogus"}), "chunk_policy", IA),
        ("param_chunk_policy_int", grpc_request([tt()], params={"chunk_policy": 5}), "chunk_policy", IA),
        ("output_unknown", grpc_request([tt()], outputs=("audio",)), "outputs", IA),
        ("unknown_model", grpc_request([tt()], model="other"), "model", NF),
        ("unknown_version", grpc_request([tt()], version="9"), "version", NF),
    ]
    out = [Case("grpc_infer", name, f, codes, grpc=req) for name, req, f, codes in rows]
    # not a protobuf message / a proto3 string field holding invalid UTF-8 (hand-made wire bytes)
    out.append(Case("grpc_infer", "undecodable_message", "request", IA, grpc=b"\xff\xff\xff\xff\x0f garbage"))
    out.append(Case("grpc_infer", "model_name_invalid_utf8", "request", IA, grpc=b"\x0a\x02\xff\xfe"))
    out.append(Case("grpc_infer", "oversized_message", None, ("RESOURCE_EXHAUSTED",),
                    grpc=grpc_request([tt(b"a" * (max_body + 1024))]), tags={"oversized"}))
    # every ModelInfer case again as a request on one decoupled stream (in-band errors)
    for c in list(out):
        if "oversized" in c.tags or isinstance(c.grpc, bytes):
            continue
        out.append(Case("grpc_stream", c.name, c.field, c.expect, grpc=c.grpc))
    return out


def build_corpus(prompt_wav: bytes, max_body: int) -> list[Case]:
    """Every malformed request, for a server whose body / upload limit is ``max_body`` bytes."""
    corpus = (openai_speech_cases(max_body) + voice_cases(prompt_wav, max_body) + kserve_json_cases(max_body)
              + kserve_binary_cases(max_body) + grpc_cases(max_body))
    ids = [c.id for c in corpus]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise AssertionError(f"duplicate corpus case ids: {sorted(dup)}")
    return corpus
