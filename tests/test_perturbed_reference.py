"""The parity tests are honest: they pass on a reference directory whose computed outputs differ
by float rounding (3e-7 relative, as another BLAS build or length gives), and fail when the
outputs differ by 1e-3 (so they do look at the data).

Builds perturbed copies with ``tests/tools/perturb_reference.py`` (symlinks, cheap) and runs a few
representative parity tests against each in a subprocess (``COSYSERVE_REFERENCE_DIR``), one per
component: frontend features, LLM log-probs, flow (every intermediate), HiFT (F0, decode, seeded
inference), the seeded end-to-end API (the case of issue 19: HiFT from upstream's mel) and the
voice cache; the 1e-3 leg runs the cheaper four of them. The full set is run by hand: see the
tool's docstring.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _reference import REPO, require_reference_dir

TOOL = Path(__file__).resolve().parent / "tools" / "perturb_reference.py"
SELECTION = [
    "tests/test_frontend.py::test_prompt_mel",
    "tests/test_llm.py::test_teacher_forced_logprobs",
    "tests/test_flow.py::test_offline_flow_case",
    "tests/test_hift.py::test_hift_case",
    "tests/test_pipeline.py::test_zero_shot_end_to_end_matches_upstream",
    "tests/test_voices.py::test_matches_upstream_spk2info",
]
SANITY = [s for s in SELECTION if "test_flow" not in s and "test_pipeline" not in s]  # the cheap ones


def _tool():
    spec = importlib.util.spec_from_file_location("perturb_reference", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(ref: Path, tests: list[str]) -> tuple[dict[str, str], str]:
    """Run ``tests`` against reference ``ref``; returns ({test id: PASSED/FAILED/...}, output)."""
    # one torch thread, as the reference was made: on a busy machine two threads were 10x slower
    env = dict(os.environ, COSYSERVE_REFERENCE_DIR=str(ref), COSYSERVE_TEST_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *tests],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    res = dict((m.group(2), m.group(1)) for m in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", out, re.M))
    return res, out


@pytest.mark.parity
@pytest.mark.slow
def test_parity_tests_pass_within_rounding_and_fail_beyond(tmp_path):
    src = require_reference_dir()
    tool = _tool()
    small, large = tmp_path / "rel3e-7", tmp_path / "rel1e-3"
    assert tool.perturb_reference(src, small, rel=3e-7, seed=1)
    assert tool.perturb_reference(src, large, rel=1e-3, seed=1)

    res, out = _run(small, SELECTION)
    assert res, out[-3000:]
    assert set(res.values()) == {"PASSED"}, {k: v for k, v in res.items() if v != "PASSED"}
    for sel in SELECTION:  # every selected test collected at least one case
        assert any(k.startswith(sel) for k in res), (sel, out[-3000:])

    res_large, out = _run(large, SANITY)
    assert set(res_large) == {k for k in res if k.split("[")[0] in SANITY}, out[-3000:]
    assert set(res_large.values()) == {"FAILED"}, {k: v for k, v in res_large.items() if v != "FAILED"}
