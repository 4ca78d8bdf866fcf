"""cosyvoice2.yaml is read as data: tags are inert, refs resolve, errors name the key."""

from __future__ import annotations

import textwrap

import pytest

from _reference import model_dir, require_reference_dir
from cosyserve.errors import ConfigError, ModelDirError
from cosyserve.models.config import Ref, Tagged, load_config, load_hyperpyyaml
from cosyserve.models.loader import open_model_dir


def test_tags_are_parsed_not_executed(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text(textwrap.dedent("""
        __seed: !apply:os.system ['touch should_not_exist']
        a: 25
        b: 2
        c: !ref <a> * <b>
        d: !ref <a>
        e: !new:some.module.Class
            x: !ref <c>
            y: [1, 2]
        f: !name:some.func
            k: 1
    """))
    data = load_hyperpyyaml(p)
    assert not (tmp_path / "should_not_exist").exists()
    assert isinstance(data["__seed"], Tagged) and data["__seed"].kind == "apply"
    assert data["c"] == 50 and data["d"] == 25
    assert isinstance(data["e"], Tagged) and data["e"].class_name == "Class"
    assert data["e"].kwargs() == {"x": 50, "y": [1, 2]}
    assert data["f"].kind == "name"


def test_bad_refs_fail_clearly(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("a: !ref <missing>\n")
    with pytest.raises(ConfigError, match="missing"):
        load_hyperpyyaml(p)
    p.write_text("a: !ref <b>\nb: !ref <a>\n")
    with pytest.raises(ConfigError, match="circular"):
        load_hyperpyyaml(p)
    p.write_text("a: 1\nb: !ref __import__('os') <a>\n")
    with pytest.raises(ConfigError):
        load_hyperpyyaml(p)


def test_reference_yaml_dimensions():
    cfg = load_config(model_dir() / "cosyvoice2.yaml")
    assert cfg.flow.estimator.static_chunk_size == cfg.chunk_size * cfg.token_mel_ratio
    assert cfg.hift.samples_per_frame * 2 * cfg.token_frame_rate == cfg.sample_rate
    assert cfg.llm.qwen["hidden_size"] == cfg.llm.llm_input_size
    assert cfg.llm.stop_token_ids == (cfg.llm.speech_token_size, cfg.llm.speech_token_size + 1,
                                      cfg.llm.speech_token_size + 2)


def test_unsupported_class_names_the_key(tmp_path):
    ref = require_reference_dir()
    text = (ref / "manifests" / "cosyvoice2.real.yaml").read_text()
    p = tmp_path / "cosyvoice2.yaml"
    p.write_text(text.replace("cosyvoice.flow.flow.CausalMaskedDiffWithXvec", "cosyvoice.flow.flow.MaskedDiffWithXvec"))
    with pytest.raises(ConfigError, match=r"flow.*MaskedDiffWithXvec"):
        load_config(p)
    p.write_text("sample_rate: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_model_dir_errors(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        open_model_dir(tmp_path / "nope")
    (tmp_path / "cosyvoice2.yaml").write_text("a: 1\n")
    with pytest.raises(ModelDirError, match="missing llm.pt, flow.pt, hift.pt"):
        open_model_dir(tmp_path)
    assert isinstance(Ref("x"), Ref)
