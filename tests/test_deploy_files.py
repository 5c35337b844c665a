"""compose.yaml, the Dockerfile, the Kubernetes manifests and the monitoring configs stay true
to the code: every module, file, port, setting and metric they name exists. (No Docker engine
or cluster here, so they are parsed, not run.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import worker.observe.metrics  # noqa: F401  (registers the metrics)
from producer import protocol
from worker.cli import COMMANDS
from worker.observe.endpoints import router
from worker.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
METRICS_PORT = 9100


def load_yaml(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text())


def load_yaml_all(path: str) -> list[Any]:
    return list(yaml.safe_load_all((ROOT / path).read_text()))


def env_of(environment: dict[str, Any] | list[dict[str, Any]]) -> dict[str, str | None]:
    """compose's mapping or Kubernetes' list of {name, value}; None: set at run time
    (Kubernetes' valueFrom)."""
    if isinstance(environment, dict):
        return {k: str(v) for k, v in environment.items()}
    return {e["name"]: str(e["value"]) if "value" in e else None for e in environment}


def assert_settings_env(env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every REDBATCH_* variable is a real setting, and the values are accepted."""
    for name, value in env.items():
        if name.startswith("REDBATCH_"):
            assert name[len("REDBATCH_"):].lower() in Settings.model_fields, name
            if value is not None and "$(" not in value:  # Kubernetes fills $(VAR) in later
                monkeypatch.setenv(name, value)
    load_settings()


def assert_python_module_command(command: list[str]) -> list[str]:
    """`python -m MODULE ...`: the module is runnable; returns its arguments."""
    assert command[:2] == ["python", "-m"], command
    module = command[2]
    assert importlib.util.find_spec(f"{module}.__main__") is not None, module
    return command[3:]


def assert_probe_path(path: str) -> None:
    """The path is answered by the probe router, not handed to /metrics."""
    def metrics_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        raise AssertionError(f"{path} is not a probe endpoint")

    seen: list[str] = []
    router(metrics_app, lambda: {"ok": True})({"PATH_INFO": path},
                                                lambda status, headers: seen.append(status))
    assert seen == ["200 OK"]


# --- compose ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml("compose.yaml")


def test_redis_is_7_with_aof_noeviction_and_a_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    volume, target = redis["volumes"][0].split(":")
    assert target == "/data" and volume in compose["volumes"]


def test_worker_service(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    worker = compose["services"]["worker"]
    args = assert_python_module_command(worker["command"])
    assert args[0] in COMMANDS
    env = env_of(worker["environment"])
    assert_settings_env(env, monkeypatch)
    assert env["REDBATCH_REDIS_URL"].startswith("redis://redis:")
    assert int(env["REDBATCH_METRICS_PORT"]) == METRICS_PORT
    assert worker["deploy"]["replicas"] >= 1
    assert "container_name" not in worker and "ports" not in worker, "blocks --scale worker=N"
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(worker["healthcheck"]["test"]))
    assert url and int(url[1]) == METRICS_PORT and url[2] == "/readyz"
    assert_probe_path(url[2])
    assert (ROOT / worker["build"] / "Dockerfile").is_file()


def test_demo_producer(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    producer = compose["services"]["producer"]
    args = assert_python_module_command(producer["command"])
    assert (ROOT / args[0]).is_file()
    assert_settings_env(env_of(producer["environment"]), monkeypatch)
    assert producer["restart"] == "no"
    assert producer["depends_on"]["worker"]["condition"] == "service_healthy"


def bind_mounts(service: dict[str, Any]) -> Iterator[tuple[Path, str]]:
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            yield ROOT / source, target


def test_monitoring_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for source, _ in bind_mounts(services[name]):
            assert source.exists(), source
    scrape = load_yaml("configs/prometheus/prometheus.yml")["scrape_configs"][0]
    discovery = scrape["dns_sd_configs"][0]
    assert discovery["names"] == ["worker"] and discovery["port"] == METRICS_PORT
    datasource = load_yaml("configs/grafana/provisioning/datasources/prometheus.yaml")
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]
    provider = load_yaml("configs/grafana/provisioning/dashboards/redbatch.yaml")
    dashboards_dir = provider["providers"][0]["options"]["path"]
    mounts = {target: source for source, target in bind_mounts(services["grafana"])}
    assert (mounts[dashboards_dir] / "redbatch.json").is_file()


def test_gpu_variant_reserves_nvidia_devices() -> None:
    worker = load_yaml("compose.gpu.yaml")["services"]["worker"]
    device = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert set(worker["build"]["args"]) <= dockerfile_args()
    assert worker["environment"]["REDBATCH_DEVICE"].startswith("cuda")


# --- Dockerfile -------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split()[0].upper(), line.partition(" ")[2].strip())
            for line in lines if line and not line.startswith("#")]


def dockerfile_args() -> set[str]:
    return {args.split("=")[0] for op, args in dockerfile() if op == "ARG"}


def test_dockerfile() -> None:
    steps = dockerfile()
    ops = [op for op, _ in steps]
    assert ops[0] == "FROM" and "slim" in steps[0][1]
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG")
    assert args["TORCH_VARIANT"] == "cpu"
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and args["TORCH_VERSION"] == pinned[1]
    copies = [shlex.split(a) for op, a in steps if op == "COPY"]
    for *sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
    install = ops.index("RUN", ops.index("COPY"))
    assert copies[0][:-1] == ["pyproject.toml"], "dependency layer first"
    assert all(op != "COPY" for op in ops[ops.index("COPY") + 1:install])
    users = [a for op, a in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert f"EXPOSE {METRICS_PORT}" in {f"{op} {a}" for op, a in steps}
    command = json.loads(next(a for op, a in reversed(steps) if op == "CMD"))
    assert_python_module_command(command)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "**/node_modules" in ignored


# --- Kubernetes -------------------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    kustomization = load_yaml("deploy/k8s/kustomization.yaml")
    found = {}
    for resource in kustomization["resources"]:
        for document in load_yaml_all(f"deploy/k8s/{resource}"):
            found[document["kind"]] = document
    return found


def test_worker_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = assert_python_module_command(container["command"])
    assert args[0] in COMMANDS
    env = env_of(container["env"])
    assert_settings_env(env, monkeypatch)
    port = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    assert port == int(env["REDBATCH_METRICS_PORT"]) == METRICS_PORT
    probes = {kind: container[kind]["httpGet"]
              for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert probe["port"] == "metrics"
        assert_probe_path(probe["path"])
    grace = float(env.get("REDBATCH_SHUTDOWN_GRACE_S")
                  or Settings.model_fields["shutdown_grace_s"].default)
    assert pod["terminationGracePeriodSeconds"] > grace
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_keda_scales_on_lag_with_pending_as_fallback() -> None:
    found = manifests()
    deployment, scaled = found["Deployment"], found["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = env_of(container["env"])
    settings = load_settings(model=env["REDBATCH_MODEL"])
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    for trigger in triggers:
        meta = trigger["metadata"]
        assert meta["stream"] == protocol.stream_key(settings.namespace, settings.model_name)
        assert meta["consumerGroup"] == settings.group
        assert meta["addressFromEnv"] in env and meta["passwordFromEnv"] in env
    signals = [set(t["metadata"]) & {"lagCount", "pendingEntriesCount"} for t in triggers]
    assert signals == [{"lagCount"}, {"pendingEntriesCount"}]
    pending_target = int(triggers[1]["metadata"]["pendingEntriesCount"])
    assert pending_target < int(env["REDBATCH_MAX_INFLIGHT"])


# --- Grafana ----------------------------------------------------------------------------------


def exported_sample_names() -> set[str]:
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name, *(family.name + suffix for suffix in
                                 ("_total", "_bucket", "_sum", "_count", "_created"))}
    return names


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "configs/grafana/dashboards/redbatch.json").read_text())
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("throughput", "latency", "batch size", "padding", "backlog", "memory"):
        assert topic in titles
    exported = exported_sample_names()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(?:redbatch|process)_[a-z_]+", target["expr"]):
                assert name in exported, f"{panel['title']}: {name}"
