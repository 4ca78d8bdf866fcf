"""Container health check: exit 0 when the server answers 200 on its readiness route.

Used by the image's ``HEALTHCHECK`` (Docker and compose); Kubernetes uses its own
``httpGet`` probes on the same routes instead. The image has no curl, so this is the
standard library only. The URL is ``$COSYSERVE_HEALTH_URL`` (default
``http://127.0.0.1:8000/v2/health/ready``: the KServe v2 readiness route of
``cosyserve serve``, which answers 200 only once the models are loaded and warmed up and
503 before that and while shutting down). Any other status, a refused connection or a
timeout (``$COSYSERVE_HEALTH_TIMEOUT`` seconds, default 4) exits 1 with one line on stderr.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/v2/health/ready"


def check(url: str, timeout: float) -> str | None:
    """None if ``url`` answers HTTP 200 within ``timeout`` seconds, else why not (one line)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as exc:  # 503 while loading / draining
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def main() -> int:
    url = os.environ.get("COSYSERVE_HEALTH_URL") or DEFAULT_URL
    try:
        timeout = float(os.environ.get("COSYSERVE_HEALTH_TIMEOUT") or 4)
    except ValueError:
        print("healthcheck: COSYSERVE_HEALTH_TIMEOUT must be a number of seconds", file=sys.stderr)
        return 1
    problem = check(url, timeout)
    if problem is not None:
        print(f"healthcheck: {url}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
