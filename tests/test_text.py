"""Text normalisation never drops user text; splitting follows upstream's rules."""

from __future__ import annotations

import pytest

from cosyserve.frontend.text import TextFrontend, keeps_content, split_paragraph


def n_chars(s: str) -> int:
    return len(s)


def test_split_keeps_everything_and_respects_limits():
    text = "第一句话。" * 30 + "最后没有标点"
    segs = split_paragraph(text, n_chars, "zh")
    assert "".join(segs) == text + "。"
    assert all(len(s) <= 80 for s in segs[:-1])
    segs = split_paragraph("One. Two? Three!", lambda s: len(s.split()), "en")
    assert segs == ["One. Two? Three!"]  # short: merged into one segment


def test_guard_detects_dropped_content():
    assert keeps_content("Dr. Smith has 3 cats.", "doctor Smith has three cats.")
    assert not keeps_content("呃我觉得", "我觉得")
    assert not keeps_content("Hello world", "Hello")


@pytest.mark.parametrize("mode", ["auto", "rules", "none"])
def test_frontend_modes(mode):
    fe = TextFrontend(lambda s: len(s.split()), mode)
    segs = fe.split("今天是2024年3月5日，天气很好。")
    assert segs and "今天" in "".join(segs)
    if fe.backend == "wetext":
        assert "二零二四" in "".join(segs)
    assert fe.split("  ") == [] and fe.split("。！？") == []
    assert fe.split("<|endofprompt|>你好") == ["<|endofprompt|>你好"]


def test_wetext_keeps_interjections_and_traditional_characters():
    fe = TextFrontend(lambda s: len(s.split()), "auto")
    if fe.backend != "wetext":
        pytest.skip("wetextprocessing not installed")
    out = "".join(fe.split("呃，我覺得這個方案不錯！價格是12元。"))
    for c in "呃覺這錯價":
        assert c in out
    assert "十二" in out
    en = "".join(fe.split("Dr. Smith paid $3 for 2 apples."))
    assert "two" in en.lower() and "smith" in en.lower()
