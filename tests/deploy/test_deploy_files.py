"""compose.yaml, the Dockerfile, the Kubernetes manifests and the monitoring configs stay true
to the code: every module, file, port, setting and metric they name exists. (No Docker engine
or cluster here, so they are parsed, not run.)

They are also held to their real schemas, offline: the Kubernetes objects to the official
OpenAPI-derived JSON schemas that `kubernetes-validate` ships (strict: unknown fields fail), the
compose files to the Compose Specification's JSON schema that `check-jsonschema` vendors. KEDA's
ScaledObject and TriggerAuthentication (CRDs) and the Kustomization (a kustomize file, not an API
object) are in neither: they are checked field by field against the fields KEDA and kustomize
define; the ObjectMeta of KEDA's objects, and the HPA KEDA makes of a ScaledObject, go to
Kubernetes' schemas. That covers the single-Redis ScaledObject and the Cluster and Sentinel ones in
deploy/k8s/cluster/ and deploy/k8s/sentinel/.

The Helm chart (deploy/helm/redbatch/) is rendered offline by Helm's own template engine (Helm
v4's Go SDK through helm-python-sdk: no helm binary, no cluster), and its objects go through the
same checks."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from kubernetes_validate.utils import all_versions, major_minor
from prometheus_client import REGISTRY

import worker.observe.metrics  # noqa: F401  (registers the metrics)
from producer import protocol
from producer.shards import default_shards, shard_stream_key, shards_key
from tests.rigs.paths import REPO_ROOT
from worker.cli import COMMANDS
from worker.observe.endpoints import router
from worker.settings import Settings, load_settings

ROOT = REPO_ROOT
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


def test_generative_worker_profile(compose: dict[str, Any],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--profile generative` adds a smollm2 worker, so the README's chat example
    (`model="smollm2"`) has a worker behind the gateway; same image, same Redis, not
    published, and the base services stay as they are (Redis unpublished, the gateway local)."""
    from worker.models import BUILTIN

    services = compose["services"]
    generative = services["worker-smollm2"]
    assert generative["profiles"] == ["generative"]
    assert generative["image"] == services["worker"]["image"] == services["gateway"]["image"]
    assert generative["build"] == services["worker"]["build"]
    assert assert_python_module_command(generative["command"]) == ["run"]
    env = env_of(generative["environment"])
    assert_settings_env(env, monkeypatch)
    assert env["REDBATCH_MODEL"] == "smollm2" and "smollm2" in BUILTIN
    assert env["REDBATCH_REDIS_URL"] == env_of(services["worker"]["environment"])[
        "REDBATCH_REDIS_URL"]
    assert env["REDBATCH_METRICS_PORT"] == str(METRICS_PORT)
    assert_scalable(generative)
    assert generative["depends_on"]["redis"]["condition"] == "service_healthy"
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)",
                    " ".join(generative["healthcheck"]["test"]))
    assert url and int(url[1]) == METRICS_PORT and url[2] == "/readyz"
    assert "ports" not in services["redis"], "Redis stays unpublished"
    assert 'model="smollm2"' in (ROOT / "README.md").read_text()
    for doc in ("README.md", "docs/deploy.md"):
        assert "--profile generative up" in (ROOT / doc).read_text(), doc


def test_demo_producer(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    producer = compose["services"]["producer"]
    args = assert_python_module_command(producer["command"])
    assert (ROOT / args[0]).is_file()
    assert_settings_env(env_of(producer["environment"]), monkeypatch)
    assert producer["restart"] == "no"
    assert producer["depends_on"]["worker"]["condition"] == "service_healthy"



def assert_gateway_env(env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every REDBATCH_* variable is a gateway setting, and the values are accepted."""
    from producer.gateway.settings import GatewaySettings, load_gateway_settings

    for name, value in env.items():
        if name.startswith("REDBATCH_"):
            assert name[len("REDBATCH_"):].lower() in GatewaySettings.model_fields, name
            if value is not None and "$(" not in value:
                monkeypatch.setenv(name, value)
    return load_gateway_settings()


def test_gateway_service(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m producer serve` on :8000 against the compose Redis, probed on /readyz."""
    gateway = compose["services"]["gateway"]
    assert assert_python_module_command(gateway["command"]) == ["serve"]
    env = env_of(gateway["environment"])
    assert env["REDBATCH_REDIS_URL"].startswith("redis://redis:")
    settings = assert_gateway_env(env, monkeypatch)
    # published on the host's loopback only: the stack has no api keys (issue 30)
    assert settings.port == 8000 and gateway["ports"] == [f"127.0.0.1:{settings.port}:8000"]
    from producer.gateway.serve import bind_refusal

    assert settings.host == "0.0.0.0" and settings.allow_unauthenticated
    assert bind_refusal(settings) is None, "the shipped stack starts"
    assert gateway["image"] == compose["services"]["worker"]["image"]
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(gateway["healthcheck"]["test"]))
    assert url and int(url[1]) == settings.port and url[2] == "/readyz"
    from producer.gateway.app import create_app

    paths = {route.path for route in create_app(settings).app.app.routes}  # in the limits
    assert {"/readyz", "/healthz", "/metrics", "/v1/embeddings", "/v1/models"} <= paths


def test_gateway_manifests(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/k8s/gateway.yaml: a Deployment serving `producer serve` and a Service on it."""
    documents = {d["kind"]: d for d in load_yaml_all("deploy/k8s/gateway.yaml")}
    assert set(documents) == {"Deployment", "Service"}
    assert "gateway.yaml" in load_yaml("deploy/k8s/kustomization.yaml")["resources"]
    deployment, service = documents["Deployment"], documents["Service"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert assert_python_module_command(container["command"]) == ["serve"]
    settings = assert_gateway_env(env_of(container["env"]), monkeypatch)
    keys = next(e for e in container["env"] if e["name"] == "REDBATCH_API_KEYS")
    assert settings.host == "0.0.0.0" and not settings.allow_unauthenticated
    assert not keys["valueFrom"]["secretKeyRef"].get("optional"), "an open bind needs keys"
    http = next(p for p in container["ports"] if p["name"] == "http")
    assert http["containerPort"] == settings.port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.request_timeout_s
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    for version in kubernetes_versions():
        for document in documents.values():
            assert kubernetes_errors(document, version) == []


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


# --- compose: the Compose Specification's schema, profiles, scaling ----------------------------


@functools.cache
def compose_validator() -> jsonschema.protocols.Validator:
    """The Compose Specification's JSON schema (compose-spec/compose-spec, as vendored by
    check-jsonschema for its check-compose-spec hook: no network)."""
    schema = get_builtin_schema("vendor.compose-spec")
    assert schema.get("title") == "Compose Specification", schema.get("title")
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def schema_errors(validator: jsonschema.protocols.Validator, instance: Any) -> list[str]:
    """Every violation, as `path.to.field: message`."""
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                  for e in validator.iter_errors(instance))


def compose_merge(base: Any, override: Any, where: str = "") -> Any:
    """`docker compose -f base -f override`, as far as our files need it: mappings merge key by
    key and the override's scalars win; `build: DIR` is short for `build: {context: DIR}`.
    Compose merges some sequences item by item (ports, volumes...): none may overlap here."""
    if where.endswith(".build"):
        base, override = ({"context": b} if isinstance(b, str) else b for b in (base, override))
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = (compose_merge(base[key], value, f"{where}.{key}")
                           if key in base else value)
        return merged
    assert not (isinstance(base, list) and isinstance(override, list)), (
        f"{where.lstrip('.')}: both files set this sequence; model compose's merge rule here")
    return override


@pytest.fixture(scope="module")
def compose_gpu(compose: dict[str, Any]) -> dict[str, Any]:
    """compose.yaml with compose.gpu.yaml applied over it."""
    return compose_merge(compose, load_yaml("compose.gpu.yaml"))


def active_services(compose: dict[str, Any], profiles: set[str]) -> set[str]:
    """The services `docker compose [--profile P ...] up` starts: those without profiles, and
    those with one of the profiles enabled."""
    return {name for name, service in compose["services"].items()
            if not service.get("profiles") or profiles & set(service["profiles"])}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """{service: condition}, from the list form or the long form."""
    found = service.get("depends_on", {})
    if isinstance(found, list):
        return dict.fromkeys(found, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in found.items()}


@pytest.mark.parametrize("path", ["compose.yaml", "compose.gpu.yaml"])
def test_compose_file_matches_the_compose_spec(path: str) -> None:
    errors = schema_errors(compose_validator(), load_yaml(path))
    assert not errors, f"{path} against the Compose Specification:\n" + "\n".join(errors)


def test_compose_gpu_override_resolves(compose_gpu: dict[str, Any],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`-f compose.yaml -f compose.gpu.yaml` is a valid project whose worker builds the CUDA
    image, keeps the base settings and still scales."""
    errors = schema_errors(compose_validator(), compose_gpu)
    assert not errors, "compose.yaml + compose.gpu.yaml:\n" + "\n".join(errors)
    worker = compose_gpu["services"]["worker"]
    assert (ROOT / worker["build"]["context"] / "Dockerfile").is_file()
    assert set(worker["build"]["args"]) <= dockerfile_args()
    env = env_of(worker["environment"])
    assert env["REDBATCH_REDIS_URL"].startswith("redis://redis:")
    assert env["REDBATCH_DEVICE"].startswith("cuda")
    assert_settings_env(env, monkeypatch)
    assert worker["image"] != compose_gpu["services"]["producer"]["image"], (
        "the CUDA image must not overwrite the CPU one the producer runs")
    assert_scalable(worker)
    device = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert device.get("count") != "all" or worker["deploy"]["replicas"] == 1, (
        "each replica would reserve every GPU of the host")


def assert_scalable(worker: dict[str, Any]) -> None:
    """`--scale worker=N` and `deploy.replicas` work: nothing pins the service to one
    container, and the two ways of setting the count agree."""
    replicas = worker["deploy"]["replicas"]
    assert isinstance(replicas, int) and replicas >= 1, replicas
    assert worker.get("scale", replicas) == replicas, "scale and deploy.replicas disagree"
    for blocker in ("container_name", "ports"):
        assert blocker not in worker, f"{blocker} blocks --scale worker=N"


def test_worker_scales(compose: dict[str, Any]) -> None:
    assert_scalable(compose["services"]["worker"])
    assert "--scale worker=" in (ROOT / "compose.yaml").read_text()


def test_every_service_has_its_profiles(compose: dict[str, Any]) -> None:
    """The default project is Redis, the worker, the demo producer and the gateway;
    `--profile monitoring` adds Prometheus and Grafana, `--profile generative` a smollm2 worker;
    no other profile exists, and each is documented."""
    profiles = {name: service.get("profiles", []) for name, service in compose["services"].items()}
    assert profiles == {"redis": [], "worker": [], "producer": [], "gateway": [],
                        "worker-smollm2": ["generative"],
                        "prometheus": ["monitoring"], "grafana": ["monitoring"]}
    header = (ROOT / "compose.yaml").read_text()
    for profile in {p for names in profiles.values() for p in names}:
        assert f"--profile {profile} up" in header, f"profile {profile} is not documented"


@pytest.mark.parametrize("profiles", [set(), {"monitoring"}, {"generative"}],
                         ids=["default", "monitoring", "generative"])
def test_profiles_resolve(compose: dict[str, Any], profiles: set[str]) -> None:
    """Every dependency of a started service is started too, and a `service_healthy` one has a
    healthcheck to become healthy by."""
    active = active_services(compose, profiles)
    expected = ({"redis", "worker", "producer", "gateway"}
                | ({"prometheus", "grafana"} if "monitoring" in profiles else set())
                | ({"worker-smollm2"} if "generative" in profiles else set()))
    assert active == expected
    services = compose["services"]
    for name in sorted(active):
        for dependency, condition in depends_on(services[name]).items():
            assert dependency in active, f"{name} depends on {dependency}, not started"
            assert condition in ("service_started", "service_healthy",
                                 "service_completed_successfully"), condition
            if condition == "service_healthy":
                check = services[dependency].get("healthcheck", {})
                assert check.get("test") and not check.get("disable"), (
                    f"{name} waits for {dependency} to be healthy: it has no healthcheck")


@pytest.mark.parametrize("path, breakage, field", [
    ("compose.yaml", ("services", "worker", "deploy", "replica", 2), "replica"),
    ("compose.yaml", ("services", "worker", "healthcheck", "intervall", "10s"), "intervall"),
    ("compose.yaml", ("services", "redis", "restart", ["always"]), "restart"),
    ("compose.gpu.yaml", ("services", "worker", "deploy", "resources", "reservation", {}),
     "reservation"),
], ids=["misspelled-replicas", "misspelled-interval", "wrong-type", "gpu-misspelled"])
def test_compose_validator_rejects_broken_files(path: str, breakage: tuple[Any, ...],
                                                field: str) -> None:
    broken = load_yaml(path)
    *parents, key, value = breakage
    node = broken
    for parent in parents:
        node = node[parent]
    node[key] = value
    errors = schema_errors(compose_validator(), broken)
    assert any(field in error for error in errors), errors


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


# --- Kubernetes: the official schemas; KEDA's and kustomize's fields --------------------------


def kubernetes_versions() -> list[str]:
    """The three newest Kubernetes minor versions kubernetes-validate ships schemas for
    (upstream supports the three newest releases)."""
    return list(dict.fromkeys(major_minor(v) for v in all_versions()))[-3:]  # sorted there


KUSTOMIZATION = ("kustomize.config.k8s.io/v1beta1", "Kustomization")
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")


def manifest_documents() -> list[tuple[str, dict[str, Any]]]:
    """(file, document) for kustomization.yaml and every resource it lists."""
    kustomization = load_yaml("deploy/k8s/kustomization.yaml")
    found = [("kustomization.yaml", kustomization)]
    for resource in kustomization["resources"]:
        found += [(resource, document) for document in load_yaml_all(f"deploy/k8s/{resource}")]
    return found


def kubernetes_errors(document: dict[str, Any], version: str) -> list[str]:
    """Strict validation (unknown fields fail) against Kubernetes' schema for its apiVersion
    and kind; [] when it passes."""
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(map(str, error.path)) or "(top)"
        return [f"{document['kind']} against Kubernetes {error.version}: {path}: {error.message}"]
    return []


@pytest.mark.parametrize("version", kubernetes_versions())
def test_manifests_match_kubernetes_schemas(version: str) -> None:
    checked = set()
    for path, document in manifest_documents():
        kind = (document["apiVersion"], document["kind"])
        if kind in (KUSTOMIZATION, SCALED_OBJECT):  # checked field by field below
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(document, version, strict=True)
            continue
        errors = kubernetes_errors(document, version)
        assert not errors, f"deploy/k8s/{path}: {errors[0]}"
        checked.add(document["kind"])
    assert "Deployment" in checked


def test_kubernetes_validator_rejects_broken_manifests() -> None:
    version = kubernetes_versions()[-1]
    deployment = manifests()["Deployment"]
    assert kubernetes_errors(deployment, version) == []

    misspelled = copy.deepcopy(deployment)
    container = misspelled["spec"]["template"]["spec"]["containers"][0]
    container["livenessProbes"] = container.pop("livenessProbe")
    [error] = kubernetes_errors(misspelled, version)
    assert "spec.template.spec.containers.0" in error and "'livenessProbes'" in error, error

    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    [error] = kubernetes_errors(wrong_type, version)
    assert "spec.replicas" in error, error

    missing = copy.deepcopy(deployment)
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]
    [error] = kubernetes_errors(missing, version)
    assert "'name' is a required property" in error, error


# Field lists for what the Kubernetes schemas do not cover. A spec maps each field to its
# check: a type, a nested spec (a mapping), [spec] (a list of such mappings) or a function
# returning an error or None; a name ending in "!" is required.
Spec = dict[str, Any]


def check_fields(value: Any, spec: Spec, where: str) -> list[str]:
    """Every unknown, missing or ill-typed field, each message naming its field path."""
    if not isinstance(value, dict):
        return [f"{where}: must be a mapping, not {type(value).__name__}"]
    known = {name.rstrip("!"): check for name, check in spec.items()}
    errors = [f"{where}.{name}: unknown field (known: {', '.join(sorted(known))})"
              for name in value if name not in known]
    errors += [f"{where}.{name[:-1]}: required field missing"
               for name in spec if name.endswith("!") and name[:-1] not in value]
    for name, check in known.items():
        if name in value:
            errors += check_value(value[name], check, f"{where}.{name}")
    return errors


def check_value(value: Any, check: Any, where: str) -> list[str]:
    if isinstance(check, dict):
        return check_fields(value, check, where)
    if isinstance(check, list):
        if not isinstance(value, list) or not value:
            return [f"{where}: must be a non-empty list"]
        return [e for i, item in enumerate(value) for e in check_value(item, check[0],
                                                                      f"{where}[{i}]")]
    if isinstance(check, type):
        ok = isinstance(value, check) and not (check is int and isinstance(value, bool))
        return [] if ok else [f"{where}: must be {check.__name__}, not {value!r}"]
    problem = check(value)
    return [f"{where}: {problem}"] if problem else []


def at_least(minimum: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            return f"must be an integer >= {minimum}, not {value!r}"
        return None
    return check


def one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"must be one of {choices}, not {value!r}"


# kustomize's Kustomization (api/types/kustomization.go), which kustomize decodes with unknown
# fields refused.
KUSTOMIZATION_SPEC: Spec = {
    "apiVersion!": one_of(KUSTOMIZATION[0]), "kind!": one_of(KUSTOMIZATION[1]),
    "metadata": dict, "openapi": dict, "namePrefix": str, "nameSuffix": str, "namespace": str,
    "commonLabels": dict, "labels": list, "commonAnnotations": dict,
    "patchesStrategicMerge": list, "patchesJson6902": list, "patches": list, "images": list,
    "imageTags": list, "replacements": list, "replicas": list, "vars": list,
    "sortOptions": dict, "resources": [str], "components": list, "crds": list, "bases": list,
    "configMapGenerator": list, "secretGenerator": list, "helmGlobals": dict,
    "helmCharts": list, "helmChartInflationGenerator": list, "generatorOptions": dict,
    "configurations": list, "generators": list, "transformers": list, "validators": list,
    "inventory": dict, "buildMetadata": list,
}


def kustomization_errors(kustomization: dict[str, Any]) -> list[str]:
    errors = check_fields(kustomization, KUSTOMIZATION_SPEC, "kustomization")
    resources = kustomization.get("resources", [])
    errors += [f"kustomization.resources: {r} does not exist"
               for r in resources if not (ROOT / "deploy/k8s" / r).is_file()]
    errors += [f"kustomization.resources: {r} is listed twice"
               for r in set(resources) if resources.count(r) > 1]
    return errors


def test_kustomization_fields() -> None:
    kustomization = load_yaml("deploy/k8s/kustomization.yaml")
    errors = kustomization_errors(kustomization)
    assert not errors, "\n".join(errors)
    on_disk = {p.name for p in (ROOT / "deploy/k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk, "a manifest kubectl apply -k leaves out"


# KEDA's ScaledObject (keda.sh/v1alpha1), as documented in "Scaling Deployments" and defined
# in apis/keda/v1alpha1/scaledobject_types.go and scaletriggers_types.go.
SCALED_OBJECT_SPEC: Spec = {
    "apiVersion!": one_of(SCALED_OBJECT[0]), "kind!": one_of(SCALED_OBJECT[1]),
    # Kubernetes' ObjectMeta: checked against its schema (keda_hpa)
    "metadata!": lambda meta: None if isinstance(meta, dict) and meta.get("name") else
    "must be a mapping with a name",
    "spec!": {
        "scaleTargetRef!": {"name!": str, "apiVersion": str, "kind": str,
                            "envSourceContainerName": str},
        "pollingInterval": at_least(1),
        "initialCooldownPeriod": at_least(0),
        "cooldownPeriod": at_least(0),
        "idleReplicaCount": at_least(0),
        "minReplicaCount": at_least(0),
        "maxReplicaCount": at_least(1),
        "fallback": {"failureThreshold!": at_least(0), "replicas!": at_least(0),
                     "behavior": one_of("static", "currentReplicas", "currentReplicasIfHigher",
                                        "currentReplicasIfLower", "scalingModifiers")},
        "advanced": {
            "restoreToOriginalReplicaCount": bool,
            "horizontalPodAutoscalerConfig": {"name": str, "behavior": dict},
            "scalingModifiers": {"formula": str, "target": str, "activationTarget": str,
                                 "metricType": one_of("AverageValue", "Value")},
        },
        "triggers!": [{
            "type!": str, "name": str, "useCachedMetrics": bool,
            "metadata!": dict,  # per trigger type: TRIGGER_METADATA
            "authenticationRef": {"name!": str, "kind": one_of("TriggerAuthentication",
                                                               "ClusterTriggerAuthentication")},
            "metricType": one_of("AverageValue", "Value", "Utilization"),
        }],
    },
}


def metadata_string(value: Any) -> str | None:
    """Trigger metadata is a map of strings: the API server refuses an unquoted 5 or true."""
    return None if isinstance(value, str) else f"must be a quoted string, not {value!r}"


def metadata_int(value: Any) -> str | None:
    return metadata_string(value) or (
        None if re.fullmatch(r"-?\d+", value) else f"must hold an integer, not {value!r}")


def metadata_bool(value: Any) -> str | None:  # Go's strconv.ParseBool
    return metadata_string(value) or (
        None if value in ("1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE",
                          "false", "False") else f"must hold a boolean, not {value!r}")


# KEDA's redis-streams scalers (docs: scalers/redis-streams, redis-cluster-streams and
# redis-sentinel-streams; pkg/scalers/redis_streams_scaler.go and the connection fields of
# redis_scaler.go). KEDA ignores keys it does not know, so a misspelt one would silently fall
# back to a default: here it fails.
STREAM_TARGETS: Spec = {  # what to scale on: the same for the three
    "stream!": metadata_string,
    "consumerGroup": metadata_string,
    "pendingEntriesCount": metadata_int,  # consumerGroup, no lagCount: XPENDING count
    "lagCount": metadata_int,  # consumerGroup: the group's lag (Redis 7+)
    "streamLength": metadata_int,  # no consumerGroup: XLEN
    "activationLagCount": metadata_int,  # active (0 -> 1 replica) above this count
}
REDIS_STREAMS_METADATA: Spec = {
    # where Redis is: address (host:port), or host and port; each value may instead be read
    # from an environment variable of the scale target's container (...FromEnv)
    "address": metadata_string, "addressFromEnv": metadata_string,
    "host": metadata_string, "hostFromEnv": metadata_string,
    "port": metadata_int, "portFromEnv": metadata_string,
    "username": metadata_string, "usernameFromEnv": metadata_string,
    "password": metadata_string, "passwordFromEnv": metadata_string,
    "databaseIndex": metadata_int, "enableTLS": metadata_bool, "unsafeSsl": metadata_bool,
    **STREAM_TARGETS,
}
# A cluster's nodes, or the sentinels: comma-separated lists (addresses, or hosts and ports)
MULTI_ADDRESS_METADATA: Spec = {
    "addresses": metadata_string, "addressesFromEnv": metadata_string,
    "hosts": metadata_string, "hostsFromEnv": metadata_string,
    "ports": metadata_string, "portsFromEnv": metadata_string,
    "username": metadata_string, "usernameFromEnv": metadata_string,
    "password": metadata_string, "passwordFromEnv": metadata_string,
    "databaseIndex": metadata_int, "enableTLS": metadata_bool, "unsafeSsl": metadata_bool,
}
REDIS_CLUSTER_STREAMS_METADATA: Spec = {**MULTI_ADDRESS_METADATA, **STREAM_TARGETS}
REDIS_SENTINEL_STREAMS_METADATA: Spec = {
    **MULTI_ADDRESS_METADATA,
    # the master's name, and the sentinels' own credentials (the master's are username/password)
    "sentinelMaster": metadata_string, "sentinelMasterFromEnv": metadata_string,
    "sentinelUsername": metadata_string, "sentinelUsernameFromEnv": metadata_string,
    "sentinelPassword": metadata_string, "sentinelPasswordFromEnv": metadata_string,
    **STREAM_TARGETS,
}
TRIGGER_METADATA: dict[str, Spec] = {
    "redis-streams": REDIS_STREAMS_METADATA,
    "redis-cluster-streams": REDIS_CLUSTER_STREAMS_METADATA,
    "redis-sentinel-streams": REDIS_SENTINEL_STREAMS_METADATA,
}
# The parameters each scaler reads from a TriggerAuthentication (its authParams); any other is
# ignored. tls/ca/cert/key/keyPassword: TLS, set there instead of enableTLS.
TLS_AUTH_PARAMS = {"tls", "ca", "cert", "key", "keyPassword"}
TRIGGER_AUTH_PARAMS: dict[str, set[str]] = {
    "redis-streams": {"address", "host", "port", "username", "password"} | TLS_AUTH_PARAMS,
    "redis-cluster-streams": {"addresses", "hosts", "ports", "username", "password"}
    | TLS_AUTH_PARAMS,
    "redis-sentinel-streams": {"addresses", "hosts", "ports", "username", "password",
                               "sentinelMaster", "sentinelUsername", "sentinelPassword"}
    | TLS_AUTH_PARAMS,
}


def redis_streams_errors(meta: dict[str, str], where: str, kind: str = "redis-streams",
                         auth_params: frozenset[str] = frozenset()) -> list[str]:
    """What KEDA would refuse, or silently ignore, in a redis*-streams trigger's metadata.
    auth_params: the parameters its TriggerAuthentication gives."""
    errors = []
    has = {name for name in meta if not name.endswith("FromEnv")}
    has |= {name.removesuffix("FromEnv") for name in meta if name.endswith("FromEnv")}
    errors += [f"{where}.{name}: set here and in the TriggerAuthentication: set one"
               for name in sorted(has & auth_params)]
    has |= auth_params
    address, host, port = (("address", "host", "port") if kind == "redis-streams" else
                           ("addresses", "hosts", "ports"))
    if address in has and has & {host, port}:
        errors.append(f"{where}: {address} and {host}/{port} both set: set one")
    elif address not in has and not {host, port} <= has:
        errors.append(f"{where}: no Redis to read: set {address}, or {host} and {port} "
                      "(or ...FromEnv, or a TriggerAuthentication parameter)")
    if kind == "redis-sentinel-streams" and "sentinelMaster" not in has:
        errors.append(f"{where}.sentinelMaster: required: the sentinels are asked for this "
                      "master (or sentinelMasterFromEnv, or a TriggerAuthentication parameter)")
    if "enableTLS" in meta and "tls" in auth_params:
        errors.append(f"{where}.enableTLS: KEDA refuses it with the TriggerAuthentication's tls")
    if "consumerGroup" in meta:
        if "streamLength" in meta:
            errors.append(f"{where}.streamLength: ignored when consumerGroup is set")
        if "lagCount" in meta and "pendingEntriesCount" in meta:
            errors.append(f"{where}.pendingEntriesCount: ignored when lagCount is set")
        if meta.get("lagCount") == "0":
            errors.append(f"{where}.lagCount: 0 means pendingEntriesCount is used instead")
    else:
        errors += [f"{where}.{name}: needs consumerGroup (without it KEDA scales on XLEN)"
                   for name in ("pendingEntriesCount", "lagCount") if name in meta]
    return errors


# KEDA's TriggerAuthentication (keda.sh/v1alpha1, apis/keda/v1alpha1/
# triggerauthentication_types.go): where a trigger's secrets come from.
TRIGGER_AUTHENTICATION = ("keda.sh/v1alpha1", "TriggerAuthentication")
TARGET_REF: Spec = {"parameter!": str, "name!": str, "key!": str}
TRIGGER_AUTHENTICATION_SPEC: Spec = {
    "apiVersion!": one_of(TRIGGER_AUTHENTICATION[0]), "kind!": one_of(TRIGGER_AUTHENTICATION[1]),
    # Kubernetes' ObjectMeta: checked against its schema (object_meta_errors)
    "metadata!": lambda meta: None if isinstance(meta, dict) and meta.get("name") else
    "must be a mapping with a name",
    "spec!": {
        "secretTargetRef": [TARGET_REF], "configMapTargetRef": [TARGET_REF],
        "env": [{"parameter!": str, "name!": str, "containerName": str}],
        "podIdentity": dict, "hashiCorpVault": dict, "azureKeyVault": dict,
        "gcpSecretManager": dict, "awsSecretManager": dict, "boundServiceAccountToken": list,
    },
}


def auth_parameters(authentication: dict[str, Any]) -> list[str]:
    """The parameters a TriggerAuthentication gives its triggers (from Secrets, ConfigMaps and
    the scale target's environment)."""
    spec = authentication.get("spec") or {}
    return [ref.get("parameter") for kind in ("secretTargetRef", "configMapTargetRef", "env")
            for ref in spec.get(kind) or [] if isinstance(ref, dict)]


def trigger_authentication_errors(authentication: dict[str, Any]) -> list[str]:
    errors = check_fields(authentication, TRIGGER_AUTHENTICATION_SPEC, "TriggerAuthentication")
    parameters = auth_parameters(authentication)
    errors += [f"TriggerAuthentication.spec: parameter {p!r} is given twice"
               for p in sorted(set(parameters)) if parameters.count(p) > 1]
    return errors


def scaled_object_errors(scaled: dict[str, Any], container_env: set[str],
                         authentications: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Every wrong, missing or misspelt field of a ScaledObject, each message naming it.
    container_env: the environment variables of the scale target's container, which KEDA
    reads ...FromEnv values from; authentications: the TriggerAuthentications by name."""
    authentications = authentications or {}
    errors = check_fields(scaled, SCALED_OBJECT_SPEC, "ScaledObject")
    spec = scaled.get("spec")
    if not isinstance(spec, dict):
        return errors
    minimum, maximum = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if isinstance(minimum, int) and isinstance(maximum, int) and minimum > maximum:
        errors.append("ScaledObject.spec: minReplicaCount > maxReplicaCount")
    idle = spec.get("idleReplicaCount")
    if isinstance(idle, int) and isinstance(minimum, int) and idle >= minimum:
        errors.append("ScaledObject.spec.idleReplicaCount: must be below minReplicaCount")
    triggers = spec.get("triggers") if isinstance(spec.get("triggers"), list) else []
    names = [t["name"] for t in triggers if isinstance(t, dict) and "name" in t]
    errors += [f"ScaledObject.spec.triggers: name {n!r} is used twice"
               for n in sorted(set(names)) if names.count(n) > 1]
    for i, trigger in enumerate(t for t in triggers if isinstance(t, dict)):
        where = f"ScaledObject.spec.triggers[{i}]"
        if "fallback" in spec and trigger.get("metricType") == "Value":
            errors.append(f"{where}.metricType: fallback works only with AverageValue")
        kind = trigger.get("type", "")
        meta_spec = TRIGGER_METADATA.get(kind)
        if meta_spec is None:
            errors.append(f"{where}.type: no field list for {kind!r} here: add "
                          "the fields KEDA documents for it to TRIGGER_METADATA")
            continue
        auth_params: frozenset[str] = frozenset()
        ref = trigger.get("authenticationRef")
        if isinstance(ref, dict) and ref.get("kind", "TriggerAuthentication") == \
                "TriggerAuthentication":
            authentication = authentications.get(ref.get("name", ""))
            if authentication is None:
                errors.append(f"{where}.authenticationRef.name: no TriggerAuthentication "
                              f"{ref.get('name')!r} next to the ScaledObject")
            else:
                auth_params = frozenset(auth_parameters(authentication))
                errors += [f"{where}.authenticationRef: parameter {p!r} of "
                           f"{ref['name']} is not read by {kind}"
                           for p in sorted(auth_params - TRIGGER_AUTH_PARAMS[kind])]
        meta = trigger.get("metadata", {})
        found = check_fields(meta, meta_spec, f"{where}.metadata")
        errors += found
        if found or not isinstance(meta, dict):
            continue
        errors += redis_streams_errors(meta, f"{where}.metadata", kind,
                                       auth_params & TRIGGER_AUTH_PARAMS[kind])
        errors += [f"{where}.metadata.{name}: {variable} is not set in the scale target's "
                   "container" for name, variable in meta.items()
                   if name.endswith("FromEnv") and variable not in container_env]
    return errors


def keda_hpa(scaled: dict[str, Any]) -> dict[str, Any]:
    """The HorizontalPodAutoscaler KEDA makes of a ScaledObject (one External metric per
    trigger), under the ScaledObject's own metadata: validated against Kubernetes' schema, it
    checks the ObjectMeta, the scale target and the replica bounds."""
    spec = scaled["spec"]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", **spec["scaleTargetRef"]}
    target.pop("envSourceContainerName", None)
    metrics = []
    for i, trigger in enumerate(spec["triggers"]):
        meta = trigger["metadata"]
        value = next((meta[k] for k in ("lagCount", "pendingEntriesCount", "streamLength")
                      if k in meta), "5")
        kind = trigger.get("metricType", "AverageValue")
        metrics.append({"type": "External", "external": {
            "metric": {"name": f"s{i}-{trigger['type']}"},
            "target": {"type": kind, ("averageValue" if kind == "AverageValue" else "value"):
                       value}}})
    hpa_spec = {"scaleTargetRef": target, "minReplicas": max(spec.get("minReplicaCount", 1), 1),
                "maxReplicas": spec.get("maxReplicaCount", 100), "metrics": metrics}
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:
        hpa_spec["behavior"] = behavior
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": scaled["metadata"], "spec": hpa_spec}


def scale_target_env(scaled: dict[str, Any] | None = None) -> set[str]:
    """The environment of the container KEDA reads ...FromEnv values from (of the single-Redis
    ScaledObject's target unless `scaled` is given)."""
    found = manifests()
    containers = found["Deployment"]["spec"]["template"]["spec"]["containers"]
    scaled = scaled or found["ScaledObject"]
    name = scaled["spec"]["scaleTargetRef"].get("envSourceContainerName")
    container = next(c for c in containers if c["name"] == name) if name else containers[0]
    return set(env_of(container["env"]))


def test_scaled_object_fields() -> None:
    scaled = manifests()["ScaledObject"]
    errors = scaled_object_errors(scaled, scale_target_env())
    assert not errors, "deploy/k8s/worker-scaledobject.yaml:\n" + "\n".join(errors)
    for version in kubernetes_versions():
        errors = kubernetes_errors(keda_hpa(scaled), version)
        assert not errors, f"the HPA KEDA makes of the ScaledObject: {errors[0]}"


@pytest.mark.parametrize("breakage, message", [
    (lambda s: s["spec"].update(pollingIntervall=s["spec"].pop("pollingInterval")),
     "ScaledObject.spec.pollingIntervall: unknown field"),
    (lambda s: s["spec"].pop("scaleTargetRef"),
     "ScaledObject.spec.scaleTargetRef: required field missing"),
    (lambda s: s["spec"]["fallback"].update(replica=s["spec"]["fallback"].pop("replicas")),
     "ScaledObject.spec.fallback.replica: unknown field"),
    (lambda s: s["spec"].update(maxReplicaCount="20"),
     "ScaledObject.spec.maxReplicaCount: must be an integer >= 1"),
    (lambda s: s["spec"]["triggers"][1]["metadata"].update(
        pendingEntriesCont=s["spec"]["triggers"][1]["metadata"].pop("pendingEntriesCount")),
     "ScaledObject.spec.triggers[1].metadata.pendingEntriesCont: unknown field"),
    (lambda s: s["spec"]["triggers"][0]["metadata"].update(lagCount=512),
     "ScaledObject.spec.triggers[0].metadata.lagCount: must be a quoted string"),
    (lambda s: s["spec"]["triggers"][0]["metadata"].pop("stream"),
     "ScaledObject.spec.triggers[0].metadata.stream: required field missing"),
    (lambda s: s["spec"]["triggers"][0]["metadata"].pop("consumerGroup"),
     "ScaledObject.spec.triggers[0].metadata.lagCount: needs consumerGroup"),
    (lambda s: s["spec"]["triggers"][0]["metadata"].update(addressFromEnv="REDIS_ADDR"),
     "ScaledObject.spec.triggers[0].metadata.addressFromEnv: REDIS_ADDR is not set"),
    (lambda s: s["spec"]["triggers"][0].update(type="redis-stream"),
     "ScaledObject.spec.triggers[0].type: no field list for 'redis-stream'"),
    (lambda s: s.update(apiVersion="keda.sh/v1"),
     "ScaledObject.apiVersion: must be one of ('keda.sh/v1alpha1',)"),
    (lambda s: s["metadata"].pop("name"), "ScaledObject.metadata: must be a mapping with a name"),
], ids=["spec-typo", "spec-missing", "fallback-typo", "spec-type", "metadata-typo",
        "metadata-unquoted", "metadata-missing", "metadata-ignored", "metadata-env",
        "trigger-type", "api-version", "no-name"])
def test_scaled_object_checker_rejects_broken_manifests(breakage: Callable[[Any], Any],
                                                        message: str) -> None:
    broken = copy.deepcopy(manifests()["ScaledObject"])
    breakage(broken)
    errors = scaled_object_errors(broken, scale_target_env())
    assert any(error.startswith(message) for error in errors), errors


# --- KEDA on a Redis Cluster and under Sentinel: deploy/k8s/<mode>/ ---------------------------
#
# Each takes the place of deploy/k8s/worker-scaledobject.yaml (the same ScaledObject name, so
# `kubectl apply -f` replaces it) and brings a TriggerAuthentication reading the workers' Secret.
KEDA_VARIANTS = {"cluster": "deploy/k8s/cluster/worker-scaledobject.yaml",
                 "sentinel": "deploy/k8s/sentinel/worker-scaledobject.yaml"}


def keda_variant(mode: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the ScaledObject, its TriggerAuthentications by name) of deploy/k8s/<mode>/."""
    documents = load_yaml_all(KEDA_VARIANTS[mode])
    kinds = [(d["apiVersion"], d["kind"]) for d in documents]
    assert kinds.count(SCALED_OBJECT) == 1, kinds
    assert set(kinds) <= {SCALED_OBJECT, TRIGGER_AUTHENTICATION}, kinds
    scaled = documents[kinds.index(SCALED_OBJECT)]
    return scaled, {d["metadata"]["name"]: d for d, kind in zip(documents, kinds, strict=True)
                    if kind == TRIGGER_AUTHENTICATION}


def worker_container() -> dict[str, Any]:
    return manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def worker_secret_keys() -> set[tuple[str, str]]:
    """(Secret, key) of every value the worker Deployment reads from a Secret."""
    return {(ref["name"], ref["key"]) for e in worker_container()["env"]
            if (ref := e.get("valueFrom", {}).get("secretKeyRef"))}


def object_meta_errors(document: dict[str, Any], version: str) -> list[str]:
    """A custom resource's metadata against Kubernetes' ObjectMeta schema (carried by a
    ConfigMap, which requires nothing else)."""
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": document["metadata"]}
    return [e.replace("ConfigMap", f"{document['kind']}.metadata", 1)
            for e in kubernetes_errors(carrier, version)]


def test_every_keda_variant_file_is_checked() -> None:
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "deploy/k8s").glob("*/*.yaml")}
    assert on_disk == set(KEDA_VARIANTS.values())


@pytest.mark.parametrize("mode", sorted(KEDA_VARIANTS))
def test_keda_variant_fields(mode: str) -> None:
    """Field by field (KEDA's CRDs are in no schema), the HPA KEDA makes of it and every
    ObjectMeta against Kubernetes' schemas; it replaces the single-Redis ScaledObject, and its
    TriggerAuthentication reads only Secret keys the workers read too."""
    scaled, authentications = keda_variant(mode)
    errors = scaled_object_errors(scaled, scale_target_env(scaled), authentications)
    for authentication in authentications.values():
        errors += trigger_authentication_errors(authentication)
    assert not errors, f"{KEDA_VARIANTS[mode]}:\n" + "\n".join(errors)
    single = manifests()["ScaledObject"]
    assert scaled["metadata"]["name"] == single["metadata"]["name"]
    assert scaled["spec"]["scaleTargetRef"] == single["spec"]["scaleTargetRef"]
    used = {t["authenticationRef"]["name"] for t in scaled["spec"]["triggers"]}
    assert used == set(authentications), "a trigger without credentials, or an unused one"
    for authentication in authentications.values():
        assert "password" in auth_parameters(authentication)
        for ref in authentication["spec"]["secretTargetRef"]:
            assert (ref["name"], ref["key"]) in worker_secret_keys(), ref
    for version in kubernetes_versions():
        for document in (scaled, *authentications.values()):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(document, version, strict=True)
            assert object_meta_errors(document, version) == []
        errors = kubernetes_errors(keda_hpa(scaled), version)
        assert not errors, f"the HPA KEDA makes of {KEDA_VARIANTS[mode]}: {errors[0]}"


def test_cluster_triggers_are_the_shard_streams() -> None:
    """One trigger per shard stream, named by producer/protocol.py for the N in the manifest;
    the scaling modifier sums their lags against the single-Redis target, and each trigger
    alone carries the per-shard target (for a KEDA without scaling modifiers)."""
    scaled, _ = keda_variant("cluster")
    settings = load_settings(model=env_of(worker_container()["env"])["REDBATCH_MODEL"])
    shards = int(scaled["metadata"]["annotations"]["redbatch/shards"])
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-cluster-streams"}
    assert [t["metadata"]["stream"] for t in triggers] == [
        shard_stream_key(settings.namespace, settings.model_name, shard)
        for shard in range(shards)]
    assert {t["metadata"]["consumerGroup"] for t in triggers} == {settings.group}
    single = next(t["metadata"] for t in manifests()["ScaledObject"]["spec"]["triggers"]
                  if "lagCount" in t["metadata"])
    for trigger in triggers:
        meta = trigger["metadata"]
        assert set(meta) & {"lagCount", "pendingEntriesCount", "streamLength"} == {"lagCount"}
        assert abs(int(meta["lagCount"]) * shards - int(single["lagCount"])) < shards, (
            "the per-shard target is the single-Redis target / N")
        assert meta["activationLagCount"] == single["activationLagCount"]
    modifier = scaled["spec"]["advanced"]["scalingModifiers"]
    assert modifier["formula"] == " + ".join(t["name"] for t in triggers)
    assert modifier["target"] == single["lagCount"] and modifier["metricType"] == "AverageValue"
    assert modifier["activationTarget"] == single["activationLagCount"]
    text = (ROOT / KEDA_VARIANTS["cluster"]).read_text()
    assert f"GET {shards_key(settings.namespace, settings.model_name)}" in text
    assert f"{default_shards(3)} for 3 masters" in text


def test_sentinel_triggers_are_the_single_redis_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sentinel shards nothing: the same stream, group and targets as on one Redis, from the
    master the sentinels name, which is the one the workers' URL (in the file) names."""
    from producer.connection import parse_target

    scaled, _ = keda_variant("sentinel")
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-sentinel-streams"}

    def targets(trigger: dict[str, Any]) -> dict[str, str]:
        fields = {name.rstrip("!") for name in STREAM_TARGETS}
        return {k: v for k, v in trigger["metadata"].items() if k in fields}

    assert [targets(t) for t in triggers] == [
        targets(t) for t in manifests()["ScaledObject"]["spec"]["triggers"]]
    [master] = {t["metadata"]["sentinelMaster"] for t in triggers}
    url = re.search(r"REDBATCH_REDIS_URL=(\S+)", (ROOT / KEDA_VARIANTS["sentinel"]).read_text())
    assert url, "the workers' URL is not in the file"
    filled = url[1].replace("$(REDIS_ADDRESS)", "s1:26379,s2:26379,s3:26379")
    target = parse_target(filled, False)
    assert (target.mode, target.service) == ("sentinel", master)
    env = env_of(worker_container()["env"])
    assert env["REDBATCH_REDIS_PASSWORD"] == "$(REDIS_PASSWORD)"  # the masters' password
    assert_settings_env({"REDBATCH_REDIS_URL": filled, "REDBATCH_REDIS_PASSWORD": "secret"},
                        monkeypatch)
    assert set(re.findall(r"\$\(\w+\)", url[1])) == {"$(REDIS_ADDRESS)"}
    assert {"REDIS_PASSWORD", "REDIS_ADDRESS"} <= set(env)


@pytest.mark.parametrize("mode, breakage, message", [
    ("cluster", lambda s, a: a["redbatch-redis-cluster"]["spec"]["secretTargetRef"][0].update(
        parameter="address"),
     "ScaledObject.spec.triggers[0].authenticationRef: parameter 'address' of "
     "redbatch-redis-cluster is not read by redis-cluster-streams"),
    ("cluster", lambda s, a: s["spec"]["triggers"][0]["metadata"].update(address="seed:6379"),
     "ScaledObject.spec.triggers[0].metadata.address: unknown field"),
    ("cluster", lambda s, a: s["spec"]["triggers"][1]["authenticationRef"].update(
        name="redbatch-redis"),
     "ScaledObject.spec.triggers[1].authenticationRef.name: no TriggerAuthentication "
     "'redbatch-redis'"),
    ("cluster", lambda s, a: s["spec"]["triggers"][2].update(name="shard0"),
     "ScaledObject.spec.triggers: name 'shard0' is used twice"),
    ("cluster", lambda s, a: a["redbatch-redis-cluster"]["spec"].update(
        secretTargetRefs=a["redbatch-redis-cluster"]["spec"].pop("secretTargetRef")),
     "TriggerAuthentication.spec.secretTargetRefs: unknown field"),
    ("sentinel", lambda s, a: s["spec"]["triggers"][0]["metadata"].pop("sentinelMaster"),
     "ScaledObject.spec.triggers[0].metadata.sentinelMaster: required"),
    ("sentinel", lambda s, a: s["spec"]["triggers"][1]["metadata"].update(
        passwordFromEnv="REDIS_PASSWORD"),
     "ScaledObject.spec.triggers[1].metadata.password: set here and in the TriggerAuthentication"),
    ("sentinel", lambda s, a: a["redbatch-redis-sentinel"]["spec"]["secretTargetRef"].pop(0),
     "ScaledObject.spec.triggers[0].metadata: no Redis to read"),
    ("sentinel", lambda s, a: a["redbatch-redis-sentinel"]["spec"]["secretTargetRef"][1].pop(
        "key"), "TriggerAuthentication.spec.secretTargetRef[1].key: required field missing"),
], ids=["auth-parameter", "single-redis-field", "auth-missing", "trigger-name-twice",
        "auth-typo", "no-master", "password-twice", "no-sentinels", "auth-key-missing"])
def test_keda_variant_checker_rejects_broken_manifests(mode: str,
                                                       breakage: Callable[[Any, Any], Any],
                                                       message: str) -> None:
    scaled, authentications = copy.deepcopy(keda_variant(mode))
    breakage(scaled, authentications)
    errors = scaled_object_errors(scaled, scale_target_env(scaled), authentications)
    for authentication in authentications.values():
        errors += trigger_authentication_errors(authentication)
    assert any(error.startswith(message) for error in errors), errors


def project_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_manifest_images_are_the_documented_build() -> None:
    """The Deployments run `redbatch:<pyproject's version>`, the tag docs/deploy.md builds (no
    `latest`: nothing publishes one), the kustomization's `images:` entry names that image so
    `kustomize edit set image` retargets both, and the KEDA prerequisite is stated."""
    image = f"redbatch:{project_version()}"
    containers = [c for file in ("worker-deployment.yaml", "gateway.yaml")
                  for d in load_yaml_all(f"deploy/k8s/{file}") if d["kind"] == "Deployment"
                  for c in d["spec"]["template"]["spec"]["containers"]]
    assert containers and {c["image"] for c in containers} == {image}
    [entry] = load_yaml("deploy/k8s/kustomization.yaml")["images"]
    assert entry == {"name": "redbatch", "newTag": project_version()}
    docs = (ROOT / "docs/deploy.md").read_text()
    assert f"docker build -t {image} ." in docs and "docker push" in docs
    assert "KEDA 2.x must be installed" in docs and "helm install keda kedacore/keda" in docs


def test_kustomization_checker_rejects_broken_files() -> None:
    kustomization = load_yaml("deploy/k8s/kustomization.yaml")
    misspelt = {**kustomization, "resource": kustomization["resources"]}
    del misspelt["resources"]
    assert "kustomization.resource: unknown field" in kustomization_errors(misspelt)[0]
    missing = {**kustomization, "resources": [*kustomization["resources"], "worker-hpa.yaml"]}
    assert kustomization_errors(missing) == [
        "kustomization.resources: worker-hpa.yaml does not exist"]


# --- the Helm chart: deploy/helm/redbatch/ ----------------------------------------------------
#
# Rendered offline by Helm's own engine (Helm v4's Go SDK, through helm-python-sdk's ctypes
# binding: no helm binary, no cluster), then held to the same checks as deploy/k8s/: every
# object to Kubernetes' schemas, the ScaledObject field by field, and the settings to the code.
CHART = ROOT / "deploy/helm/redbatch"
HELM_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "keda": {"keda": {"enabled": True}},
    "created-secrets": {"keda": {"enabled": True},
                        "redis": {"secret": {"create": True, "address": "redis:6379",
                                             "password": "p@ss:/#word"}},
                        "gateway": {"apiKeys": {"create": True, "keys": ["k1", "k2"]}}},
    "custom": {"image": {"repository": "registry.example.com/team/redbatch", "tag": "0.1.0-cu128"},
               "worker": {"model": "mypkg.models:MyModel", "replicas": 3, "metricsPort": 9200,
                          "extraEnv": [{"name": "REDBATCH_DEVICE", "value": "cuda"}],
                          "resources": {"limits": {"nvidia.com/gpu": 1}}},
               "gateway": {"port": 8080, "service": {"port": 8000}},
               "keda": {"enabled": True}},
    "no-gateway": {"gateway": {"enabled": False}},
}


def helm_render(values: dict[str, Any], name: str = "redbatch") -> dict[str, str]:
    """{template path: rendered text}, as `helm template NAME deploy/helm/redbatch` with the
    values given over values.yaml."""
    import helm_python

    with helm_python.Chart.load(str(CHART)) as chart:
        return chart.render(copy.deepcopy(values), name=name, namespace="default",
                            is_install=True)


@functools.cache
def helm_objects(case: str) -> tuple[dict[str, Any], ...]:
    """Every object the chart renders for HELM_CASES[case] (NOTES.txt is not one)."""
    rendered = helm_render(HELM_CASES[case])
    return tuple(document for path, text in sorted(rendered.items()) if path.endswith(".yaml")
                 for document in yaml.safe_load_all(text) if document)


def helm_object(case: str, kind: str, component: str | None = None) -> dict[str, Any]:
    [found] = [d for d in helm_objects(case) if d["kind"] == kind and (
        component is None
        or d["metadata"]["labels"]["app.kubernetes.io/component"] == component)]
    return found


def helm_container(case: str, component: str) -> dict[str, Any]:
    [container] = helm_object(case, "Deployment", component)["spec"]["template"]["spec"][
        "containers"]
    return container


@pytest.mark.parametrize("case", sorted(HELM_CASES))
def test_helm_chart_renders_valid_objects(case: str) -> None:
    """Every rendered object against Kubernetes' schemas (strict), the ScaledObject against
    KEDA's fields and its HPA against Kubernetes', as for deploy/k8s/."""
    objects = helm_objects(case)
    kinds = sorted(d["kind"] for d in objects)
    keda = HELM_CASES[case].get("keda", {}).get("enabled", False)
    gateway = HELM_CASES[case].get("gateway", {}).get("enabled", True)
    created = 2 if case == "created-secrets" else 0
    assert kinds == sorted(["Deployment"] + ["Deployment", "Service"] * gateway
                           + ["ScaledObject"] * keda + ["Secret"] * created)
    for document in objects:
        if (document["apiVersion"], document["kind"]) == SCALED_OBJECT:
            env = set(env_of(helm_container(case, "worker")["env"]))
            errors = scaled_object_errors(document, env)
            assert not errors, f"{case}: the chart's ScaledObject:\n" + "\n".join(errors)
            for version in kubernetes_versions():
                assert object_meta_errors(document, version) == []
                assert kubernetes_errors(keda_hpa(document), version) == []
            continue
        for version in kubernetes_versions():
            assert kubernetes_errors(document, version) == [], (case, document["kind"])


def test_helm_chart_defaults_mirror_deploy_k8s() -> None:
    """With its defaults (and KEDA on), the chart renders what deploy/k8s/ holds: the same
    containers, pod settings, Service and ScaledObject; only labels and the pull policy differ."""
    k8s = manifests()
    gateway_k8s = {d["kind"]: d for d in load_yaml_all("deploy/k8s/gateway.yaml")}
    pairs = [(helm_object("keda", "Deployment", "worker"), k8s["Deployment"]),
             (helm_object("keda", "Deployment", "gateway"), gateway_k8s["Deployment"])]
    for chart, plain in pairs:
        assert chart["metadata"]["name"] == plain["metadata"]["name"]
        [container] = chart["spec"]["template"]["spec"]["containers"]
        assert container.pop("imagePullPolicy") == "IfNotPresent"
        assert [container] == plain["spec"]["template"]["spec"]["containers"]
        for field in ("securityContext", "terminationGracePeriodSeconds"):
            assert chart["spec"]["template"]["spec"][field] == plain["spec"]["template"][
                "spec"][field]
        assert (chart["spec"]["template"]["metadata"]["annotations"]
                == plain["spec"]["template"]["metadata"]["annotations"])
    assert "replicas" not in pairs[0][0]["spec"], "KEDA owns the count"
    assert helm_object("default", "Deployment", "worker")["spec"]["replicas"] == 1
    assert pairs[1][0]["spec"]["replicas"] == gateway_k8s["Deployment"]["spec"]["replicas"]
    assert (helm_object("default", "Service")["spec"]["ports"]
            == gateway_k8s["Service"]["spec"]["ports"])
    assert helm_object("keda", "ScaledObject")["spec"] == k8s["ScaledObject"]["spec"]


@pytest.mark.parametrize("case", sorted(HELM_CASES))
def test_helm_chart_wiring(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image from values (the appVersion, pyproject's version, by default); every REDBATCH_*
    variable a real worker or gateway setting; Secrets never optional; selectors, ports and
    probes agree; KEDA reads the stream and group the workers serve."""
    from producer.gateway.serve import bind_refusal

    values = HELM_CASES[case]
    image = values.get("image", {})
    expected = f"{image.get('repository', 'redbatch')}:{image.get('tag', project_version())}"
    assert load_yaml("deploy/helm/redbatch/Chart.yaml")["appVersion"] == project_version()
    worker = helm_container(case, "worker")
    assert worker["image"] == expected
    assert assert_python_module_command(worker["command"]) == ["run"]
    worker_env = env_of(worker["env"])
    with monkeypatch.context() as patch:
        assert_settings_env(worker_env, patch)
        settings = load_settings()
    assert settings.model == values.get("worker", {}).get("model", "minilm")
    metrics = next(p for p in worker["ports"] if p["name"] == "metrics")
    assert metrics["containerPort"] == settings.metrics_port
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    refs = [e["valueFrom"]["secretKeyRef"] for e in worker["env"]
            if "secretKeyRef" in e.get("valueFrom", {})]
    gateway_on = values.get("gateway", {}).get("enabled", True)
    if gateway_on:
        gateway = helm_container(case, "gateway")
        assert gateway["image"] == expected
        assert assert_python_module_command(gateway["command"]) == ["serve"]
        with monkeypatch.context() as patch:
            gateway_settings = assert_gateway_env(env_of(gateway["env"]), patch)
        assert gateway_settings.host == "0.0.0.0" and not gateway_settings.allow_unauthenticated
        assert bind_refusal(gateway_settings) is not None, "without its keys it must not start"
        keys = next(e for e in gateway["env"] if e["name"] == "REDBATCH_API_KEYS")
        assert keys["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
        refs += [e["valueFrom"]["secretKeyRef"] for e in gateway["env"]
                 if "secretKeyRef" in e.get("valueFrom", {})]
        http = next(p for p in gateway["ports"] if p["name"] == "http")
        assert http["containerPort"] == gateway_settings.port
        deployment, service = helm_object(case, "Deployment", "gateway"), helm_object(
            case, "Service")
        pod = deployment["spec"]["template"]
        assert service["spec"]["selector"] == pod["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
        assert service["spec"]["ports"][0]["targetPort"] == "http"
        assert pod["spec"]["terminationGracePeriodSeconds"] > gateway_settings.request_timeout_s
    assert refs and not any(ref.get("optional") for ref in refs)
    secrets = {d["metadata"]["name"]: d for d in helm_objects(case) if d["kind"] == "Secret"}
    for ref in refs:  # a Secret the chart makes holds every key the pods read of it
        if ref["name"] in secrets:
            assert ref["key"] in secrets[ref["name"]]["stringData"], ref
    workers = helm_object(case, "Deployment", "worker")
    assert workers["spec"]["selector"]["matchLabels"] == workers["spec"]["template"][
        "metadata"]["labels"]
    assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        settings.shutdown_grace_s)
    if values.get("keda", {}).get("enabled"):
        scaled = helm_object(case, "ScaledObject")
        assert scaled["spec"]["scaleTargetRef"]["name"] == workers["metadata"]["name"]
        assert "replicas" not in workers["spec"]
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["metadata"]["stream"] == protocol.stream_key(settings.namespace,
                                                                        settings.model_name)
            assert trigger["metadata"]["consumerGroup"] == settings.group
            assert {trigger["metadata"][f"{f}FromEnv"] for f in ("address", "password")} <= set(
                worker_env)
        pending = next(t["metadata"] for t in scaled["spec"]["triggers"]
                       if "pendingEntriesCount" in t["metadata"])
        assert int(pending["pendingEntriesCount"]) < settings.max_inflight
    else:
        assert workers["spec"]["replicas"] == values.get("worker", {}).get("replicas", 1)


@pytest.mark.parametrize("case", sorted(HELM_CASES))
def test_helm_lint(case: str) -> None:
    """`helm lint --strict` finds nothing above INFO (the only one: Chart.yaml has no icon)."""
    import helm_python

    report = helm_python.lint(str(CHART), copy.deepcopy(HELM_CASES[case]), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []


def test_helm_values_schema() -> None:
    """values.schema.json (Helm checks values against it before rendering) accepts values.yaml
    and the worker's log formats, and Helm refuses a misspelt or ill-typed value with it."""
    import helm_python

    schema = json.loads((CHART / "values.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    assert schema_errors(validator, load_yaml("deploy/helm/redbatch/values.yaml")) == []
    log_format = Settings.model_fields["log_format"].metadata[0].pattern
    formats = schema["properties"]["worker"]["properties"]["logFormat"]["enum"]
    assert all(re.fullmatch(log_format, f) for f in formats)
    assert set(re.findall(r"\w+", log_format)) == set(formats)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"keda": {"enabled": "true"}}, "/keda/enabled"),
        ({"worker": {"replica": 2}}, "'replica' not allowed"),
        ({"keda": {"lagCount": "512"}}, "/keda/lagCount")]
    for values, message in refused:
        with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
            helm_render(values)


def test_helm_created_secrets_hold_the_values() -> None:
    secrets = {d["metadata"]["name"]: d for d in helm_objects("created-secrets")
               if d["kind"] == "Secret"}
    assert secrets["redbatch-redis"]["stringData"] == {"address": "redis:6379",
                                                      "password": "p@ss:/#word"}
    assert secrets["redbatch-gateway"]["stringData"] == {"api-keys": "k1,k2"}


@pytest.mark.parametrize("values, message", [
    ({"redis": {"secret": {"create": True, "password": "p"}}}, "redis.secret.address"),
    ({"redis": {"secret": {"create": True, "address": "r:6379"}}}, "redis.secret.password"),
    ({"redis": {"secret": {"name": ""}}}, "redis.secret.name is required"),
    ({"gateway": {"apiKeys": {"create": True}}}, "gateway.apiKeys.keys must list"),
    ({"gateway": {"apiKeys": {"secretName": ""}}}, "gateway.apiKeys.secretName is required"),
], ids=["redis-address", "redis-password", "redis-secret-name", "no-keys", "no-keys-secret"])
def test_helm_chart_refuses_missing_secrets(values: dict[str, Any], message: str) -> None:
    """No Redis credentials, no api keys for the open gateway: the render fails, saying what."""
    import helm_python

    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        helm_render(values)


def test_helm_chart_is_documented() -> None:
    readme = (CHART / "README.md").read_text()
    assert "helm install" in readme and "keda.enabled=true" in readme
    for value in ("image.repository", "image.tag", "redis.secret", "gateway.apiKeys"):
        assert value in readme, value
    assert "deploy/helm/redbatch" in (ROOT / "docs/deploy.md").read_text()


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
