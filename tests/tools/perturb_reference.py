"""Write a perturbed copy of a reference directory, to check that the parity tests are honest.

The parity tests promise a relative L2 tolerance (``tests/_reference.py``: ``PARITY_TOL`` 1e-4),
not bit-exactness: a reference directory in the same format made with another BLAS build, thread
count or length rounds differently (~1e-7..1e-6 relative). This tool makes such a directory from
a real one: every floating-point tensor that upstream *computed* (mel, speech, source, F0, logp,
hidden states, features, filters, the speaker cache's features...) gets Gaussian noise of
``--rel`` times its own RMS, i.e. a relative L2 change of ``--rel``; inputs stay as they are.

    python tests/tools/perturb_reference.py SRC DST [--rel 3e-7] [--seed 0] [--copy]

With ``--rel 3e-7`` every parity test must still pass against DST
(``COSYSERVE_REFERENCE_DIR=DST``); with ``--rel 1e-3`` the parity tests of the perturbed
outputs must fail (the sanity check that the tests look at the data at all).
``tests/test_perturbed_reference.py`` runs a few representative ones both ways.

What is left unperturbed, and why:

* integer and boolean tensors (token ids, lengths, flags) and float tensors holding only 0/1
  (HiFT's voiced flags ``uv``): discrete by nature;
* inputs that the tests feed to our code: ``prompt_feat``, ``embedding``, ``llm_embedding``, input
  waveforms (``prompt_wav_*``, ``speech_16k``), HiFT's input ``mel`` (kind ``hift``) and the stored
  random draws (``rand_ini``, ``sine_std_noise``);
* what the tests feed to HiFT's phase integration: the mels passed to the *seeded* HiFT (``mel``
  of ``e2e`` cases, ``c<i>_flow_mel`` and ``c<i>_hift_mel_in`` of ``stream`` cases) and the
  F0 passed to the excitation (``f0`` and ``f0_upsampled`` of ``hift`` cases). The excitation integrates F0 into
  a phase, so independent noise on such an input and on the output computed from it (which a
  real reference never has: there, the output is computed from that very input) grows along the
  utterance: 3e-7 on ``f0_upsampled`` gives 1.4e-4 on ``sine_waves`` (measured), the reason for
  the waveform tolerance (docs/architecture.md). These tensors are still checked as outputs
  against our own computation (flow mels in the ``flow`` cases, our F0 against ``f0``).

Everything not rewritten is symlinked (``--copy``: copied) from SRC, so DST is cheap.
Algorithm: plain NumPy/torch; no upstream code.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch

INPUT_NAMES = {"prompt_feat", "embedding", "llm_embedding", "rand_ini", "sine_std_noise", "prompt_wav_24k",
               "speech_16k"}
PHASE_INPUTS = {"e2e": re.compile(r"mel"), "stream": re.compile(r"c\d+_(flow_mel|hift_mel_in)"),
                "hift": re.compile(r"mel|f0|f0_upsampled")}


def is_perturbed(name: str, kind: str | None, t: torch.Tensor) -> bool:
    """Whether tensor ``name`` of a case of ``kind`` is a computed float output (see module doc)."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    if name in INPUT_NAMES:
        return False
    pat = PHASE_INPUTS.get(kind or "")
    if pat is not None and pat.fullmatch(name):
        return False
    if bool(((t == 0) | (t == 1)).all()):  # flags stored as float
        return False
    return True


def perturb_tensor(t: torch.Tensor, rel: float, gen: torch.Generator) -> torch.Tensor:
    """``t`` plus Gaussian noise of ``rel`` times its RMS (float64 maths, stored in ``t``'s dtype)."""
    x = t.double()
    rms = x.pow(2).mean().sqrt()
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    return (x + rel * rms * noise).to(t.dtype)


def _link(src: Path, dst: Path, copy: bool) -> None:
    if copy:
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=False)
        else:
            shutil.copy2(src, dst)
    else:
        dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def _needs_rewrite(p: Path) -> bool:
    return (p.suffix == ".safetensors" and p.parent.name == "cases") or p.name == "spk2info.pt"


def _rewrite_cases_file(src: Path, dst: Path, rel: float, gen: torch.Generator, log: list) -> None:
    from safetensors.torch import load_file, save_file

    kind = None
    side = src.with_suffix(".json")
    if side.is_file():
        try:
            kind = json.loads(side.read_text(encoding="utf-8")).get("kind")
        except (json.JSONDecodeError, AttributeError):
            kind = None
    tensors = load_file(str(src))
    out = {}
    for name, t in tensors.items():
        if is_perturbed(name, kind, t):
            out[name] = perturb_tensor(t, rel, gen).contiguous()
            log.append((str(src), name))
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst))


def _perturb_obj(obj, rel: float, gen: torch.Generator, where: str, log: list):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() and not bool(((obj == 0) | (obj == 1)).all()):
            log.append(where)
            return perturb_tensor(obj, rel, gen)
        return obj
    if isinstance(obj, dict):
        return {k: _perturb_obj(v, rel, gen, f"{where}/{k}", log) for k, v in obj.items()}
    return obj


def _rewrite_spk2info(src: Path, dst: Path, rel: float, gen: torch.Generator, log: list) -> None:
    """Speaker caches hold upstream's frontend outputs (prompt mel, embeddings): perturbed."""
    obj = torch.load(src, map_location="cpu", weights_only=True)
    torch.save(_perturb_obj(obj, rel, gen, str(src), log), dst)


def _mirror(src: Path, dst: Path, rel: float, gen: torch.Generator, copy: bool, log: list) -> None:
    """Recreate ``src`` at ``dst``: folders holding files to rewrite are real folders, the rest links."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        q = dst / p.name
        if p.is_dir() and any(_needs_rewrite(f) for f in p.rglob("*")):
            _mirror(p, q, rel, gen, copy, log)
        elif p.is_file() and _needs_rewrite(p):
            if p.suffix == ".safetensors":
                _rewrite_cases_file(p, q, rel, gen, log)
            else:
                _rewrite_spk2info(p, q, rel, gen, log)
        else:
            _link(p, q, copy)


def perturb_reference(src: Path, dst: Path, rel: float = 3e-7, seed: int = 0, copy: bool = False) -> list:
    """Write the perturbed copy of reference directory ``src`` to ``dst`` (must not exist or be
    empty). Returns the list of perturbed tensors. Raises ``ValueError`` if ``src`` has no
    ``cases/`` folder or ``dst`` is not empty."""
    src, dst = Path(src), Path(dst)
    if not (src / "cases").is_dir():
        raise ValueError(f"{src} is not a reference directory (no cases/ folder)")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty")
    if not rel > 0:
        raise ValueError(f"--rel must be positive, got {rel}")
    gen = torch.Generator().manual_seed(seed)
    log: list = []
    _mirror(src, dst, rel, gen, copy, log)
    return log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="reference directory (with cases/)")
    ap.add_argument("dst", type=Path, help="output directory (created; must be empty)")
    ap.add_argument("--rel", type=float, default=3e-7, help="relative L2 of the noise per tensor (default 3e-7)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copy", action="store_true", help="copy untouched files instead of symlinking them")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every perturbed tensor")
    a = ap.parse_args(argv)
    try:
        log = perturb_reference(a.src, a.dst, a.rel, a.seed, a.copy)
    except (ValueError, OSError) as e:
        print(f"perturb_reference: {e}", file=sys.stderr)
        return 2
    if a.verbose:
        for item in log:
            print(item if isinstance(item, str) else f"{item[0]}: {item[1]}")
    print(f"perturbed {len(log)} tensors by {a.rel:g} relative L2 into {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
