"""Operator routes: the admission settings of a running server.

* ``GET /admin/admission`` — the settings in effect (``mode``: ``"auto"``, ``"off"`` or a fixed number of
  streams; ``target``; ``start_share``; ``lm_alone``; ``start_cost``; ``slack_margin``: seconds of slack below
  which a streaming chunk is a close call; ``slack_recover``: seconds per stream the slack guard's cap grows back;
  ``contention_fit``; ``pace_half_life``: seconds, the averaging of the batch-latency pace the capacity is read at;
  the ``serve --admission*`` options), with the capacity gauge (streams, as
  ``cosyserve_capacity_streams``), the admission limit and the streams admitted.
* ``PATCH /admin/admission`` — a JSON object with any of those settings changes them without a restart (the
  capacity model keeps what it measured; streams already admitted keep running): for tuning a live server and
  for benchmarks that compare settings on one server start (``benchmarks/capacity_startup.sh`` ``SWEEP``). An
  unknown setting, a wrong type or a value out of range is a 400 naming it, and nothing changes. Answers
  ``{"settings": ...}`` as they will be from the engine's next step (a ``GET`` then shows the limit they give).
* ``POST /admin/admission/reset`` — the capacity model forgets what it measured (the admission of a fresh server,
  slow start included; streams already admitted keep running); body ``{"calibrate": true}`` (optional, default
  false) then runs the start-up calibration (``serve --admission-calibrate``) again. For measuring a fresh
  server's first ramp several times on one server start (``SWEEP`` entries with ``"reset"``). Answers
  ``{"reset": true, "calibrated": <LM-only requests finished, or null>}``; an unknown field or a non-boolean
  ``calibrate`` is a 400.

Behind the API key like every non-health route (``--api-key``). Through the router (``serve --workers N``) a
``PATCH`` goes to every worker (:mod:`cosyserve.server.router`).
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request

from ..engine.core import ADMISSION_SETTINGS
from ..errors import InvalidInputError
from .state import ServerState

router = APIRouter()


def _engine(request: Request):
    """The :class:`~cosyserve.engine.async_engine.AsyncEngine` of a ready server (NotReadyError, a 503, while it
    loads)."""
    st: ServerState = request.app.state.cosyserve
    st.require_ready()
    return st.engine


@router.get("/admin/admission")
async def get_admission(request: Request):
    """The settings in effect, the capacity gauge (streams; null before any measurement in ``off`` mode), the
    admission limit and the streams admitted now."""
    core = _engine(request).core
    cap = core.capacity_streams
    return {"settings": core.admission_settings(), "capacity_streams": cap if math.isfinite(cap) else None,
            "admission_limit": core.admission_limit, "admitted": core.active_count}


@router.post("/admin/admission/reset")
async def reset_admission(request: Request, body: dict | None = None):
    """Forget the capacity model's measurements, then with ``{"calibrate": true}`` calibrate again (module doc)."""
    _engine(request)
    body = body or {}
    unknown = sorted(set(body) - {"calibrate"})
    if unknown:
        raise InvalidInputError(f"unknown field {unknown[0]!r} (only 'calibrate')", unknown[0])
    calibrate = body.get("calibrate", False)
    if not isinstance(calibrate, bool):
        raise InvalidInputError("calibrate must be true or false", "calibrate")
    st: ServerState = request.app.state.cosyserve
    return await st.reset_admission(calibrate)


@router.patch("/admin/admission")
async def patch_admission(body: dict, request: Request):
    """Change the settings named in ``body`` (module doc); 400 naming a bad one."""
    engine = _engine(request)
    if not body:
        raise InvalidInputError(f"no admission setting given ({', '.join(ADMISSION_SETTINGS)})", "body")
    return {"settings": engine.set_admission(**body)}
