"""The Helm chart (charts/crossdraft), rendered by the real Helm engine and checked against Kubernetes schemas.

No cluster needed. Helm comes from scripts/get-helm.sh (cached under .cache/tools; HELM=/path overrides);
if it cannot be had, these tests FAIL rather than skip. Manifests are validated offline with
kubernetes-validate (strict: unknown fields are errors) for every Kubernetes version in K8S_VERSIONS.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
from pathlib import Path

import kubernetes_validate  # test dependency: kubernetes-validate (offline Kubernetes schemas)
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "crossdraft"
GET_HELM = ROOT / "scripts" / "get-helm.sh"
RELEASE, NAMESPACE = "cd", "crossdraft-test"
FULL = f"{RELEASE}-crossdraft"
K8S_VERSIONS = ("1.29.0", "1.32.0")

# CRDs: no upstream schema in kubernetes-validate; checked by the assertions below instead.
CRD_KINDS = {"ServiceMonitor"}

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
CHEAP_POOL = {"crossdraft.io/pool": "cheap-gpu"}
OTEL_ENDPOINT = "http://otel-collector.observability:4317"
TARGET_HUB, DRAFTER_HUB = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"
TARGET_SHA = "0e9e39f249a16976918f6564b8830bc894c89659"
TARGET_GGUF, DRAFTER_GGUF = "example-org/Target-8B-GGUF", "example-org/Drafter-0.5B-GGUF"
POOL_HUB, POOL_CPU = "meta-llama/Llama-3.2-1B-Instruct", "smollm2-135m"  # the "drafters" variant's two kinds
L4_POOL = {"crossdraft.io/pool": "l4"}

VARIANTS: dict[str, dict] = {
    "default": {},
    "cpu": {"__file__": "values-cpu.yaml"},
    "external-redis": {
        "redis": {"external": {"existingSecret": "crossdraft-redis", "key": "url"}},
        "gateway": {"apiKeys": {"existingSecret": "crossdraft-api-keys", "key": "keys"}},
    },
    "otel": {"otel": {"endpoint": OTEL_ENDPOINT, "protocol": "grpc"}},
    "ingress-autoscaling": {
        "drafter": {
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                            "customMetric": {"name": "crossdraft_drafter_active_sessions", "targetAverageValue": "24"}},
            "modelCache": {"existingClaim": "crossdraft-models"},
        },
        "verifier": {"replicaCount": 3, "pdb": {"minAvailable": 2},
                     "modelCache": {"perPodClaim": {"enabled": True, "size": "80Gi", "storageClassName": "fast"}}},
        "gateway": {
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 12},
            "ingress": {"enabled": True, "className": "nginx",
                        "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"},
                        "hosts": [{"host": "llm.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}],
                        "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]},
        },
        "redis": {"persistence": {"enabled": True, "size": "2Gi"}},
        "networkPolicy": {"metricsNamespaceSelector": {"kubernetes.io/metadata.name": "monitoring"}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    },
    # Hub ids, a pinned revision, the token from a Secret as env, an existing shared cache claim, a mirror
    "hub": {
        "verifier": {"model": TARGET_HUB, "revision": TARGET_SHA},
        "drafter": {"model": f"{DRAFTER_HUB}@main"},
        "hub": {"hfTokenSecret": {"name": "hf-token", "key": "hf_token", "mountAs": "env"},
                "cache": {"existingClaim": "hf-models"}, "endpoint": "https://hf-mirror.internal"},
    },
    # repos of GGUFs: the target by quantisation tag (and a revision), the drafter's GGUF named by modelFile
    "hub-gguf": {
        "verifier": {"model": f"{TARGET_GGUF}:Q4_K_M@v2"},
        "drafter": {"model": DRAFTER_GGUF, "modelFile": "Q8_0/drafter-Q8_0.gguf", "revision": TARGET_SHA},
    },
    # TLS everywhere (certificates from existing Secrets) and an external Redis over TLS with a password
    "tls": {
        "tls": {"enabled": True, "gatewaySecret": "gw-public-tls", "modelServerSecret": "models-tls",
                "gatewayClientSecret": "gw-client-tls"},
        "redis": {"external": {"existingSecret": "crossdraft-redis", "key": "url",
                               "passwordSecret": {"name": "redis-auth", "key": "password"},
                               "caSecret": {"name": "redis-ca", "key": "ca.crt"}}},
    },
    # the token as a file from the Secret, a PVC the chart creates, no init container; per-pod verifier claims
    "hub-file-token": {
        "verifier": {"model": TARGET_HUB, "trustRemoteCode": True,
                     "modelCache": {"perPodClaim": {"enabled": True, "size": "80Gi"}}},
        "drafter": {"model": DRAFTER_HUB, "revision": "v1.0"},
        "hub": {"hfTokenSecret": {"name": "hf-token"}, "download": {"enabled": False},
                "cache": {"create": {"enabled": True, "size": "300Gi", "storageClassName": "nfs"}}},
    },
    # a pool of drafter kinds beside the drafter block (issue 41): a Hub model on another GPU pool with a
    # batching setting of its own, and a CPU kind (no GPU, any node, its own port, no PDB); nothing else set
    "drafters": {
        "drafters": [
            {"name": "llama", "model": POOL_HUB, "replicaCount": 3,
             "resources": {"requests": {"cpu": "3", "memory": "12Gi"}, "limits": {"memory": "24Gi"}},
             "nodeSelector": L4_POOL, "batching": {"maxRows": 8}},
            {"name": "tiny-cpu", "model": POOL_CPU, "replicaCount": 1, "device": "cpu", "dtype": "float32",
             "gpu": {"count": 0}, "nodeSelector": None, "tolerations": [], "ports": {"grpc": 50071},
             "resources": {"requests": {"cpu": "4", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
             "pdb": {"enabled": False}},
        ],
    },
}


# -------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        out = subprocess.run(["bash", str(GET_HELM)], capture_output=True, text=True, timeout=600, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        pytest.fail(f"scripts/get-helm.sh could not provide helm: {e}\n{getattr(e, 'stderr', '')}")
    path = out.stdout.strip().splitlines()[-1]
    ver = subprocess.run([path, "version", "--short"], capture_output=True, text=True)
    if ver.returncode != 0:
        pytest.fail(f"{path} is not a working helm: {ver.stderr}")
    return path


@pytest.fixture(scope="session")
def variant_files(tmp_path_factory) -> dict[str, list[str]]:
    """Variant name -> helm `-f` arguments."""
    d = tmp_path_factory.mktemp("values")
    args = {}
    for name, values in VARIANTS.items():
        if "__file__" in values:
            args[name] = ["-f", str(CHART / values["__file__"])]
        elif values:
            p = d / f"{name}.yaml"
            p.write_text(yaml.safe_dump(values))
            args[name] = ["-f", str(p)]
        else:
            args[name] = []
    return args


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@functools.lru_cache(maxsize=None)
def _template(helm: str, extra: tuple[str, ...], kube_version: str) -> list[dict]:
    r = _run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version, *extra])
    assert r.returncode == 0, f"helm template failed:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="session")
def render(helm, variant_files):
    def _render(variant: str, kube_version: str = K8S_VERSIONS[-1]) -> list[dict]:
        return _template(helm, tuple(variant_files[variant]), kube_version)
    return _render


def find(docs, kind, name=None) -> dict:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name}, got {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def kinds(docs) -> set[str]:
    return {d["kind"] for d in docs}


def pod_spec(doc) -> dict:
    return doc["spec"]["template"]["spec"]


def container(doc) -> dict:
    (c,) = pod_spec(doc)["containers"]
    return c


def env_of(doc) -> dict[str, dict]:
    return {e["name"]: e for e in container(doc).get("env", [])}


def workloads(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def drafter(docs):
    return find(docs, "Deployment", f"{FULL}-drafter")


def verifier(docs):
    return find(docs, "StatefulSet", f"{FULL}-verifier")


def gateway(docs):
    return find(docs, "Deployment", f"{FULL}-gateway")


# -------------------------------------------------------------------------------- lint + schema validation


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_clean(helm, variant_files, variant):
    r = _run([helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *variant_files[variant]])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[ERROR]" not in r.stdout and "[WARNING]" not in r.stdout, r.stdout


@pytest.mark.parametrize("kube_version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manifests_valid_for_kubernetes(render, variant, kube_version):
    assert kube_version in kubernetes_validate.utils.all_versions(), "kubernetes-validate lacks this version"
    docs = render(variant, kube_version)
    errors, checked = [], 0
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, kube_version, strict=True)
            checked += 1
        except Exception as e:  # ValidationError, SchemaNotFoundError, ...
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {getattr(e, 'message', e)}")
    assert not errors, "\n".join(errors)
    assert checked >= 15, f"only {checked} manifests validated"


def test_crd_kinds_only_when_enabled(render):
    assert not kinds(render("default")) & CRD_KINDS
    sms = [d for d in render("ingress-autoscaling") if d["kind"] == "ServiceMonitor"]
    assert {s["metadata"]["name"] for s in sms} == {f"{FULL}-drafter", f"{FULL}-verifier", f"{FULL}-gateway"}
    for s in sms:
        assert s["apiVersion"] == "monitoring.coreos.com/v1"
        assert s["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (ep,) = s["spec"]["endpoints"]
        assert ep["port"] == ("http" if s["metadata"]["name"].endswith("gateway") else "metrics")
        assert ep["path"] == "/metrics"


# -------------------------------------------------------------------------------- values schema


@pytest.mark.parametrize("bad_set", [
    "drafter.replicaCount=-1",
    "gateway.replicaCount=-3",
    "verifier.replicaCount=-1",
    "drafter.unknownKey=1",
    "unknownTopLevel=1",
    "redis.external.url=redis://user:pw@host:6379",  # no plain-text URL knob: only existingSecret
    "gateway.apiKeys.value=sk-plaintext",  # no plain-text API keys knob
    "drafter.device=tpu",
    "verifier.device=gpu",
    "drafter.dtype=int4",
    "drafter.quantize=int2",
    "verifier.quantize=int8",  # the target's weights stay exact: no such knob for the verifier
    "drafter.gpu.count=-1",
    "gateway.ports.http=70000",
    "otel.endpoint=collector:4317",
    "gateway.admission.maxConcurrentRequests=0",
    "hub.hfTokenSecret.value=hf_plaintext",  # no plain-text token knob: only a Secret reference
    "hub.token=hf_plaintext",
    "hub.hfTokenSecret.mountAs=plain",
    "verifier.revision=main@other",
    "drafter.modelFile=/abs/model.gguf",
    "verifier.modelFile=model.safetensors",
    "verifier.modelFile=../up.gguf",
    "hub.cache.create.size=lots",
    "hub.endpoint=mirror.internal",
    "gateway.pipeline=sometimes",
    # drafters entries: a name (the gateway's NAME, also a DNS label) and a model, and the drafter's own rules
    "drafters[0].model=m",
    "drafters[0].name=a",
    "drafters[0].name=Llama,drafters[0].model=m",
    "drafters[0].name=a_b,drafters[0].model=m",
    "drafters[0].name=-a,drafters[0].model=m",
    "drafters[0].name=a-,drafters[0].model=m",
    "drafters[0].name=" + "a" * 41 + ",drafters[0].model=m",
    "drafters[0].name=a,drafters[0].model=m,drafters[0].replicaCount=-1",
    "drafters[0].name=a,drafters[0].model=m,drafters[0].device=tpu",
    "drafters[0].name=a,drafters[0].model=m,drafters[0].serviceAccount.create=false",  # the drafter's, shared
    "drafters[0].name=a,drafters[0].model=m,drafters[0].unknownKey=1",
])
def test_schema_rejects_bad_values(helm, bad_set):
    for cmd in (["template", RELEASE], ["lint"]):
        r = _run([helm, *cmd, str(CHART), "--set", bad_set])
        assert r.returncode != 0, f"helm {cmd[0]} accepted --set {bad_set}"
        assert "schema" in (r.stdout + r.stderr).lower() or "at '/" in r.stdout + r.stderr, r.stdout + r.stderr


def test_autoscaling_without_metric_is_rejected(helm):
    r = _run([helm, "template", RELEASE, str(CHART), "--set", "gateway.autoscaling.enabled=true",
              "--set", "gateway.autoscaling.targetCPUUtilizationPercentage=0"])
    assert r.returncode != 0 and "targetCPUUtilizationPercentage or customMetric.name" in r.stderr


def _undocumented_keys(path: Path) -> list[str]:
    """Keys without a `# --` comment (helm-docs style). Children of a documented key are its value."""
    missing, lines = [], path.read_text().splitlines()
    skip_deeper_than = None
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z0-9_.\-/]+):(.*)$", line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent = len(m.group(1))
        if skip_deeper_than is not None:
            if indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        j, documented = i - 1, False
        while j >= 0 and lines[j].strip().startswith("#"):
            documented |= lines[j].strip().startswith("# --")
            j -= 1
        is_section = m.group(3).strip() == ""
        if documented:
            skip_deeper_than = indent
        elif not is_section:
            missing.append(f"{path.name}:{i + 1}: {line.strip()}")
    return missing


@pytest.mark.parametrize("name", ["values.yaml", "values-cpu.yaml"])
def test_every_value_is_documented(name):
    assert not _undocumented_keys(CHART / name)


def test_chart_metadata():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (meta["apiVersion"], meta["version"], str(meta["appVersion"])) == ("v2", "0.1.0", "0.1.0")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {"drafter", "verifier", "gateway", "redis", "otel"} <= set(values)


# -------------------------------------------------------------------------------- GPUs and node pools


def test_gpu_pools_default(render):
    docs = render("default")
    d, v = drafter(docs), verifier(docs)
    for doc, pool in ((d, CHEAP_POOL), (v, H100)):
        res = container(doc)["resources"]
        assert res["requests"]["nvidia.com/gpu"] == 1 and res["limits"]["nvidia.com/gpu"] == 1
        assert pod_spec(doc)["nodeSelector"] == pool
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(doc)["tolerations"]
        assert env_of(doc)["CROSSDRAFT_DEVICE"]["value"] == "cuda"
        assert env_of(doc)["CROSSDRAFT_CUDA_GRAPHS"]["value"] == "auto"  # (on for CUDA: crossdraft.runtime.graphs)
        assert env_of(doc)["CROSSDRAFT_CPU_TURNS"]["value"] == "auto"  # (CPU servers only: crossdraft.runtime.turns)
    for name in ("gateway", "redis"):
        doc = next(w for w in workloads(docs) if w["metadata"]["name"] == f"{FULL}-{name}")
        assert "nvidia.com/gpu" not in str(container(doc)["resources"])
        assert "nodeSelector" not in pod_spec(doc)


def test_cpu_variant_has_no_gpus(render):
    docs = render("cpu")
    for w in workloads(docs):
        spec = pod_spec(w)
        assert "nvidia.com/gpu" not in str(container(w)["resources"]), w["metadata"]["name"]
        assert not spec.get("nodeSelector") and not spec.get("tolerations"), w["metadata"]["name"]
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm == {"drafter-model": "smollm2-135m", "verifier-model": "qwen2.5-coder-0.5b"}
    for doc in (drafter(docs), verifier(docs)):
        env = env_of(doc)
        assert env["CROSSDRAFT_DEVICE"]["value"] == "cpu"
        assert env["CROSSDRAFT_DTYPE"]["value"] in ("float32", "bfloat16")
    # int8 drafter weights on a CPU are the server's own auto choice; the verifier has no such knob
    assert env_of(drafter(docs))["CROSSDRAFT_QUANTIZE"]["value"] == "auto"
    assert "CROSSDRAFT_QUANTIZE" not in env_of(verifier(docs))
    # Single replicas: no PDB that would block node drains for the model servers.
    assert {p["metadata"]["name"] for p in docs if p["kind"] == "PodDisruptionBudget"} == set()


# -------------------------------------------------------------------------------- probes, security, resources


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_probes_resources_security_everywhere(render, variant):
    docs = render(variant)
    names = {w["metadata"]["name"] for w in workloads(docs)}
    assert names >= {f"{FULL}-drafter", f"{FULL}-verifier", f"{FULL}-gateway"}
    for w in workloads(docs):
        c, spec, name = container(w), pod_spec(w), w["metadata"]["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, f"{name} lacks {probe}"
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], name
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        tmp = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/tmp"]
        assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[tmp], name


def test_model_servers_use_grpc_probes(render):
    docs = render("default")
    for doc, port in ((drafter(docs), 50061), (verifier(docs), 50062)):
        c = container(doc)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port, "service": ""}
        sp = c["startupProbe"]
        assert sp["periodSeconds"] * sp["failureThreshold"] >= 20 * 60, "startup must cover model download + load"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": port, "metrics": 9090}
        env = env_of(doc)
        assert env["CROSSDRAFT_PORT"]["value"] == str(port) and env["CROSSDRAFT_METRICS_PORT"]["value"] == "9090"
        assert env["CROSSDRAFT_HOST"]["value"] == "0.0.0.0" and env["CROSSDRAFT_HOME"]["value"] == "/models"
        assert env["CROSSDRAFT_MODEL"]["valueFrom"]["configMapKeyRef"]["name"] == f"{FULL}-models"


def test_gateway_uses_http_probes(render):
    c = container(gateway(render("default")))
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTP"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTP"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "grpc": 50051}


# -------------------------------------------------------------------------------- services and discovery


@pytest.mark.parametrize("variant", ["default", "cpu"])
def test_headless_services_and_gateway_discovery(render, variant):
    docs = render(variant)
    for comp, port in (("drafter", 50061), ("verifier", 50062)):
        svc = find(docs, "Service", f"{FULL}-{comp}")
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": port, "metrics": 9090}
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == comp
    assert verifier(docs)["spec"]["serviceName"] == f"{FULL}-verifier"
    env = env_of(gateway(docs))
    assert env["CROSSDRAFT_DISCOVERY"]["value"] == "kubernetes"
    assert env["CROSSDRAFT_DRAFTER_SERVICE"]["value"] == f"{FULL}-drafter"
    assert env["CROSSDRAFT_VERIFIER_SERVICE"]["value"] == f"{FULL}-verifier"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    gsvc = find(docs, "Service", f"{FULL}-gateway")["spec"]
    assert gsvc["type"] == "ClusterIP" and "clusterIP" not in gsvc
    assert {p["name"]: p["port"] for p in gsvc["ports"]} == {"http": 8000, "grpc": 50051}


def test_model_choice_comes_from_configmap(render):
    docs = render("default")
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm == {"drafter-model": "qwen2.5-coder-0.5b", "verifier-model": "qwen2.5-coder-1.5b"}
    g = gateway(docs)
    env = env_of(g)
    assert env["CROSSDRAFT_TARGET_TOKENIZER"]["valueFrom"]["configMapKeyRef"]["key"] == "verifier-model"
    assert env["CROSSDRAFT_DRAFTER_TOKENIZER"]["valueFrom"]["configMapKeyRef"]["key"] == "drafter-model"
    assert container(g)["envFrom"] == [{"configMapRef": {"name": f"{FULL}-gateway-config"}}]
    gcm = find(docs, "ConfigMap", f"{FULL}-gateway-config")["data"]
    assert {"CROSSDRAFT_DEFAULT_TEMPERATURE", "CROSSDRAFT_DEFAULT_MAX_NEW_TOKENS", "CROSSDRAFT_DRAFTER_TIMEOUT_S",
            "CROSSDRAFT_SESSION_TTL_S", "CROSSDRAFT_MAX_NEW_TOKENS_LIMIT"} <= set(gcm)
    # admission control reaches the gateway's flags (--max-concurrent-requests & co.)
    assert (gcm["CROSSDRAFT_MAX_CONCURRENT_REQUESTS"], gcm["CROSSDRAFT_MAX_QUEUED_REQUESTS"],
            gcm["CROSSDRAFT_QUEUE_TIMEOUT_S"]) == ("256", "256", "30")


# -------------------------------------------------------------------------------- RBAC and service accounts


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rbac_is_endpointslices_read_only(render, variant):
    docs = render(variant)
    assert not kinds(docs) & {"ClusterRole", "ClusterRoleBinding"}
    role = find(docs, "Role", f"{FULL}-gateway")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    rb = find(docs, "RoleBinding", f"{FULL}-gateway")
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{FULL}-gateway"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULL}-gateway", "namespace": NAMESPACE}]
    sas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert sas[f"{FULL}-gateway"]["automountServiceAccountToken"] is True
    for comp in ("drafter", "verifier"):
        assert sas[f"{FULL}-{comp}"]["automountServiceAccountToken"] is False
    assert pod_spec(gateway(docs))["serviceAccountName"] == f"{FULL}-gateway"
    for doc, comp in ((drafter(docs), "drafter"), (verifier(docs), "verifier")):
        assert pod_spec(doc)["serviceAccountName"] == f"{FULL}-{comp}"
        assert pod_spec(doc)["automountServiceAccountToken"] is False


# -------------------------------------------------------------------------------- secrets


EXTERNAL_REDIS = {"external-redis", "tls"}
SECRETISH = re.compile(r"(API_KEY|PASSWORD|SECRET|CREDENTIAL|(^|_)TOKEN$|^REDIS_URL$)", re.I)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_plain_text_secrets(render, variant):
    docs = render(variant)
    assert "Secret" not in kinds(docs), "the chart never creates Secrets: it references existing ones"
    for w in workloads(docs):
        for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", []):
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]) and not (e["name"] == "REDIS_URL" and variant not in EXTERNAL_REDIS):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (w["metadata"]["name"], e)
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        for k, v in cm["data"].items():
            assert not SECRETISH.search(k) and "redis" not in v.lower(), (cm["metadata"]["name"], k)
    env = env_of(gateway(docs))
    if variant in EXTERNAL_REDIS:
        assert "value" not in env["REDIS_URL"]
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "crossdraft-redis", "key": "url"}
        if variant == "external-redis":
            assert env["CROSSDRAFT_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "crossdraft-api-keys",
                                                                               "key": "keys"}
    else:
        assert env["REDIS_URL"]["value"] == f"redis://{FULL}-redis:6379/0"  # bundled: no credentials in it
        assert "CROSSDRAFT_API_KEYS" not in env


def test_external_redis_skips_bundled_redis(render):
    names = {(d["kind"], d["metadata"]["name"]) for d in render("external-redis")}
    assert not {n for n in names if n[1] == f"{FULL}-redis"}
    bundled = {(d["kind"], d["metadata"]["name"]) for d in render("default")}
    assert {("StatefulSet", f"{FULL}-redis"), ("Service", f"{FULL}-redis"),
            ("NetworkPolicy", f"{FULL}-redis")} <= bundled
    redis = find(render("default"), "StatefulSet", f"{FULL}-redis")
    image = container(redis)["image"]
    assert re.fullmatch(r".*redis:7\.\d+\.\d+", image), image
    assert "volumeClaimTemplates" not in redis["spec"]  # no persistence by default
    persisted = find(render("ingress-autoscaling"), "StatefulSet", f"{FULL}-redis")
    assert persisted["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"


# -------------------------------------------------------------------------------- OTel


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_otel_env_only_when_endpoint_set(render, variant):
    docs = render(variant)
    for doc, comp in ((drafter(docs), "drafter"), (verifier(docs), "verifier"), (gateway(docs), "gateway")):
        env = env_of(doc)
        otel = {k for k in env if k.startswith("OTEL_")}
        if variant == "otel":
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == OTEL_ENDPOINT
            assert env["OTEL_TRACES_EXPORTER"]["value"] == "otlp"
            assert env["OTEL_SERVICE_NAME"]["value"] == f"crossdraft-{comp}"
        else:
            assert not otel, (comp, otel)


# -------------------------------------------------------------------------------- HPA, ingress, PDB


def test_ingress_and_autoscaling(render):
    docs = render("ingress-autoscaling")
    hpas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {f"{FULL}-drafter", f"{FULL}-gateway"}
    assert all(h["apiVersion"] == "autoscaling/v2" for h in hpas.values())
    dh = hpas[f"{FULL}-drafter"]["spec"]
    assert dh["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-drafter"}
    assert (dh["minReplicas"], dh["maxReplicas"]) == (2, 6)
    assert {m["type"] for m in dh["metrics"]} == {"Resource", "Pods"}
    assert "replicas" not in drafter(docs)["spec"] and "replicas" not in gateway(docs)["spec"]
    ing = find(docs, "Ingress", f"{FULL}-gateway")
    assert ing["apiVersion"] == "networking.k8s.io/v1" and ing["spec"]["ingressClassName"] == "nginx"
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": f"{FULL}-gateway", "port": {"name": "http"}}
    assert ing["spec"]["tls"] == [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]
    # Defaults: no HPA, no Ingress, fixed replicas.
    default = render("default")
    assert not kinds(default) & {"HorizontalPodAutoscaler", "Ingress"}
    assert drafter(default)["spec"]["replicas"] == 2


def test_pdbs_and_model_cache(render):
    docs = render("default")
    pdbs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {f"{FULL}-drafter", f"{FULL}-verifier", f"{FULL}-gateway"}
    assert all(p["maxUnavailable"] == 1 for p in pdbs.values())
    vol = {v["name"]: v for v in pod_spec(drafter(docs))["volumes"]}["models"]
    assert vol["emptyDir"]["sizeLimit"] == "20Gi"
    big = render("ingress-autoscaling")
    assert find(big, "PodDisruptionBudget", f"{FULL}-verifier")["spec"] == {
        "minAvailable": 2, "selector": {"matchLabels": {"app.kubernetes.io/name": "crossdraft",
                                                        "app.kubernetes.io/instance": RELEASE,
                                                        "app.kubernetes.io/component": "verifier"}}}
    vol = {v["name"]: v for v in pod_spec(drafter(big))["volumes"]}["models"]
    assert vol == {"name": "models", "persistentVolumeClaim": {"claimName": "crossdraft-models"}}
    v = verifier(big)
    assert "models" not in {x["name"] for x in pod_spec(v)["volumes"]}
    (vct,) = v["spec"]["volumeClaimTemplates"]
    assert vct["metadata"]["name"] == "models" and vct["spec"]["storageClassName"] == "fast"


# -------------------------------------------------------------------------------- network policies


def _gateway_selector():
    return {"app.kubernetes.io/name": "crossdraft", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "gateway"}


def test_network_policies(render):
    docs = render("default")
    pols = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(pols) == {f"{FULL}-{c}" for c in ("drafter", "verifier", "redis", "gateway")}
    for comp in ("drafter", "verifier"):
        grpc_rule, metrics_rule = pols[f"{FULL}-{comp}"]["ingress"]
        assert grpc_rule["from"] == [{"podSelector": {"matchLabels": _gateway_selector()}}]
        assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
        assert metrics_rule == {"from": [{"podSelector": {}}], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    (redis_rule,) = pols[f"{FULL}-redis"]["ingress"]
    assert redis_rule["from"] == [{"podSelector": {"matchLabels": _gateway_selector()}}]
    (gw_rule,) = pols[f"{FULL}-gateway"]["ingress"]
    assert "from" not in gw_rule and {p["port"] for p in gw_rule["ports"]} == {"http", "grpc"}
    # A configurable metrics namespace.
    big = {d["metadata"]["name"]: d["spec"] for d in render("ingress-autoscaling") if d["kind"] == "NetworkPolicy"}
    assert big[f"{FULL}-verifier"]["ingress"][1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_notes_show_how_to_connect(helm):
    r = _run([helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE])
    assert r.returncode == 0, r.stderr
    notes = r.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{FULL}-gateway 8000:http" in notes
    assert f"port-forward svc/{FULL}-gateway 50051:grpc" in notes
    assert "curl -s http://127.0.0.1:8000/v1/completions" in notes


def test_gateway_drain_matches_the_pod_grace_period(helm, render):
    """SIGTERM drains the gateway (--drain-timeout-s); a preStop sleep lets endpoints drop the pod
    first; the grace period covers both, so the kubelet never kills a draining gateway."""
    g = gateway(render("default"))
    assert container(g)["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert pod_spec(g)["terminationGracePeriodSeconds"] == 40  # 5 + 30 + 5
    gcm = find(render("default"), "ConfigMap", f"{FULL}-gateway-config")["data"]
    assert gcm["CROSSDRAFT_DRAIN_TIMEOUT_S"] == "30"
    docs = _template(helm, ("--set", "gateway.drain.timeoutSeconds=100", "--set", "gateway.drain.preStopSeconds=0"),
                     K8S_VERSIONS[-1])
    g = gateway(docs)
    assert "lifecycle" not in container(g)
    assert pod_spec(g)["terminationGracePeriodSeconds"] == 105


def test_gateway_pipeline_and_load_gate_values_are_its_env(helm, render):
    """gateway.pipeline, gateway.loadGate and gateway.branch are the gateway's --pipeline, --load-gate and
    --branch, through CROSSDRAFT_PIPELINE, CROSSDRAFT_LOAD_GATE and CROSSDRAFT_BRANCH in its ConfigMap (auto, off
    and off by default); likewise
    gateway.drafterStartWaitSeconds and --drafter-start-wait-s. A values file's
    `off` is YAML 1.1's false: pipeline takes it for off, and loadGate is a boolean."""
    gcm = find(render("default"), "ConfigMap", f"{FULL}-gateway-config")["data"]
    assert gcm["CROSSDRAFT_PIPELINE"] == "auto" and gcm["CROSSDRAFT_LOAD_GATE"] == gcm["CROSSDRAFT_BRANCH"] == "off"
    docs = _template(helm, ("--set", "gateway.pipeline=false", "--set", "gateway.loadGate=true",
                            "--set", "gateway.branch=true",
                            "--set", "gateway.drafterStartWaitSeconds=30"), K8S_VERSIONS[-1])
    data = find(docs, "ConfigMap", f"{FULL}-gateway-config")["data"]
    assert data["CROSSDRAFT_PIPELINE"] == "off" and data["CROSSDRAFT_LOAD_GATE"] == data["CROSSDRAFT_BRANCH"] == "on"
    assert data["CROSSDRAFT_DRAFTER_START_WAIT_S"] == "30"  # (--drafter-start-wait-s)
    assert "CROSSDRAFT_PIPELINE" not in find(docs, "ConfigMap", f"{FULL}-models")["data"]


# -------------------------------------------------------------------------------- Hugging Face Hub ids


def _all_env(c) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def test_hub_ids_revision_token_env_and_shared_cache(render):
    docs = render("hub")
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm == {"drafter-model": f"{DRAFTER_HUB}@main", "verifier-model": TARGET_HUB, "verifier-revision": TARGET_SHA}
    for doc, comp in ((drafter(docs), "drafter"), (verifier(docs), "verifier")):
        spec = pod_spec(doc)
        (init,) = spec["initContainers"]
        assert init["name"] == "download-model"
        assert init["image"] == container(doc)["image"]
        assert init["command"] == ["python", "-m", "crossdraft.cli", "models", "download"]
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        assert init["resources"]["limits"]["memory"] and "nvidia.com/gpu" not in str(init["resources"])
        for c in (init, container(doc)):
            env = _all_env(c)
            assert env["CROSSDRAFT_MODEL"]["valueFrom"]["configMapKeyRef"] == {"name": f"{FULL}-models",
                                                                               "key": f"{comp}-model"}
            if comp == "verifier":
                assert env["CROSSDRAFT_REVISION"]["valueFrom"]["configMapKeyRef"] == {
                    "name": f"{FULL}-models", "key": "verifier-revision"}
            else:
                assert "CROSSDRAFT_REVISION" not in env  # the @main in the id says it
            assert env["HF_HOME"]["value"] == "/hf-cache"
            assert env["HF_TOKEN"] == {"name": "HF_TOKEN",
                                       "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "hf_token"}}}
            assert "HF_TOKEN_PATH" not in env
            assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.internal"
            assert "CROSSDRAFT_TRUST_REMOTE_CODE" not in env  # never unless asked for
            assert {"name": "hf-cache", "mountPath": "/hf-cache"} in c["volumeMounts"]
        # the download happened in the init container: the server only loads, from the cache
        assert _all_env(container(doc))["HF_HUB_OFFLINE"]["value"] == "1"
        assert "HF_HUB_OFFLINE" not in _all_env(init)
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["hf-cache"] == {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf-models"}}
        assert "hf-token" not in vols
    assert "PersistentVolumeClaim" not in kinds(docs)  # an existing claim: nothing created
    # the gateway takes a Hub model's tokenizer from its server (digest-checked): no Hub, token or cache
    genv = env_of(gateway(docs))
    assert not {"CROSSDRAFT_TARGET_TOKENIZER", "CROSSDRAFT_DRAFTER_TOKENIZER", "HF_TOKEN", "HF_HOME"} & set(genv)
    assert "initContainers" not in pod_spec(gateway(docs))


def test_hub_gguf_repos_model_file_and_tag(render):
    """A GGUF repo named with :QUANT is a Hub id (downloaded by the init container, tokenizer from the
    server); modelFile reaches the init container and the server as CROSSDRAFT_MODEL_FILE."""
    docs = render("hub-gguf")
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm == {"drafter-model": DRAFTER_GGUF, "verifier-model": f"{TARGET_GGUF}:Q4_K_M@v2",
                  "drafter-revision": TARGET_SHA, "drafter-model-file": "Q8_0/drafter-Q8_0.gguf"}
    for doc, comp in ((drafter(docs), "drafter"), (verifier(docs), "verifier")):
        (init,) = pod_spec(doc)["initContainers"]
        assert init["command"] == ["python", "-m", "crossdraft.cli", "models", "download"]
        for c in (init, container(doc)):
            env = _all_env(c)
            if comp == "drafter":
                assert env["CROSSDRAFT_MODEL_FILE"]["valueFrom"]["configMapKeyRef"] == {
                    "name": f"{FULL}-models", "key": "drafter-model-file"}
            else:
                assert "CROSSDRAFT_MODEL_FILE" not in env and "CROSSDRAFT_REVISION" not in env  # the id says both
    genv = env_of(gateway(docs))
    assert not {"CROSSDRAFT_TARGET_TOKENIZER", "CROSSDRAFT_DRAFTER_TOKENIZER"} & set(genv)


def test_hub_token_file_and_created_cache(render):
    docs = render("hub-file-token")
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == f"{FULL}-hf-cache"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "300Gi"
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm["drafter-revision"] == "v1.0" and "verifier-revision" not in cm
    for doc, comp in ((drafter(docs), "drafter"), (verifier(docs), "verifier")):
        spec, c = pod_spec(doc), container(doc)
        assert "initContainers" not in spec  # download.enabled=false: the server downloads at startup
        env = _all_env(c)
        assert "HF_HUB_OFFLINE" not in env and "HF_TOKEN" not in env
        assert env["HF_TOKEN_PATH"]["value"] == "/var/run/secrets/huggingface/token"
        assert env["HF_HOME"]["value"] == "/hf-cache"
        assert ("CROSSDRAFT_TRUST_REMOTE_CODE" in env) == (comp == "verifier")
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["hf-token"] == {"name": "hf-token", "mountPath": "/var/run/secrets/huggingface",
                                      "readOnly": True}
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["hf-token"]["secret"] == {"secretName": "hf-token", "defaultMode": 0o440,
                                              "items": [{"key": "token", "path": "token"}]}
        assert vols["hf-cache"]["persistentVolumeClaim"]["claimName"] == f"{FULL}-hf-cache"
    # the per-pod verifier claim still holds /models; the Hub cache is the shared claim beside it
    assert verifier(docs)["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "models"


@pytest.mark.parametrize("variant", ["hub", "hub-file-token"])
def test_no_token_value_anywhere(render, variant):
    """The token only ever comes from the Secret: no env value, no ConfigMap entry, no argument."""
    docs = render(variant)
    for w in workloads(docs):
        for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", []):
            for e in c.get("env", []):
                if re.search(r"(^|_)TOKEN$", e["name"]):  # HF_TOKEN, HUGGING_FACE_HUB_TOKEN
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (w["metadata"]["name"], e)
                assert not str(e.get("value", "")).startswith("hf_"), e
            assert not [a for a in c.get("args", []) + c.get("command", []) if "hf_" in str(a).lower()]
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert not [k for k in cm["data"] if re.search(r"(^|[_-])TOKEN(_PATH)?$", k, re.I)], cm["data"]
        assert not [v for v in cm["data"].values() if str(v).startswith("hf_")], cm["data"]


def test_local_models_keep_their_defaults(render):
    docs = render("default")
    for doc in (drafter(docs), verifier(docs)):
        env = env_of(doc)
        assert "initContainers" not in pod_spec(doc)
        assert env["HF_HOME"]["value"] == "/models/huggingface"  # inside the pod's model cache
        assert not {"HF_HUB_OFFLINE", "HF_TOKEN", "HF_TOKEN_PATH", "CROSSDRAFT_REVISION"} & set(env)
        assert "hf-cache" not in {v["name"] for v in pod_spec(doc)["volumes"]}
    assert "PersistentVolumeClaim" not in kinds(docs)


# -------------------------------------------------------------------------------- TLS

def _volumes(doc) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec(doc)["volumes"]}


def _mounts(doc) -> dict[str, dict]:
    return {m["name"]: m for m in container(doc)["volumeMounts"]}


def test_tls_certificates_are_files_from_secrets_and_probes_follow(render):
    docs = render("tls")
    for doc, grpc_port in ((drafter(docs), 50061), (verifier(docs), 50062)):
        c, env = container(doc), env_of(doc)
        assert env["CROSSDRAFT_TLS_CERT_FILE"]["value"] == "/etc/crossdraft/tls/server/tls.crt"
        assert env["CROSSDRAFT_TLS_KEY_FILE"]["value"] == "/etc/crossdraft/tls/server/tls.key"
        assert env["CROSSDRAFT_TLS_CLIENT_CA_FILE"]["value"] == "/etc/crossdraft/tls/server/ca.crt"  # mutual TLS
        assert env["CROSSDRAFT_HEALTH_PORT"]["value"] == "50070"
        assert _volumes(doc)["tls-server"]["secret"]["secretName"] == "models-tls"
        assert _mounts(doc)["tls-server"] == {"name": "tls-server", "mountPath": "/etc/crossdraft/tls/server",
                                              "readOnly": True}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": grpc_port, "metrics": 9090, "health": 50070}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the kubelet has no client certificate
            assert c[probe]["grpc"] == {"port": 50070, "service": ""}
    g = gateway(docs)
    c, env = container(g), env_of(g)
    assert env["CROSSDRAFT_TLS_CERT_FILE"]["value"] == "/etc/crossdraft/tls/public/tls.crt"
    assert env["CROSSDRAFT_UPSTREAM_TLS_CA_FILE"]["value"] == "/etc/crossdraft/tls/client/ca.crt"
    assert env["CROSSDRAFT_UPSTREAM_TLS_CERT_FILE"]["value"] == "/etc/crossdraft/tls/client/tls.crt"
    assert env["CROSSDRAFT_UPSTREAM_TLS_SERVER_NAME"]["value"] == f"{FULL}-modelserver"
    vols = _volumes(g)
    assert vols["tls-public"]["secret"]["secretName"] == "gw-public-tls"
    assert vols["tls-client"]["secret"]["secretName"] == "gw-client-tls"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
    # Redis over TLS: password from its Secret, the CA as a file
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "password"}
    assert env["CROSSDRAFT_REDIS_TLS_CA_FILE"]["value"] == "/etc/crossdraft/redis-ca/ca.crt"
    assert vols["redis-ca"]["secret"] == {"secretName": "redis-ca", "defaultMode": 0o440,
                                          "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    # the health-only port is open to probes; gRPC still only from the gateway
    pols = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    rules = pols[f"{FULL}-verifier"]["ingress"]
    assert rules[0]["ports"] == [{"port": "grpc", "protocol": "TCP"}] and "from" in rules[0]
    assert {"ports": [{"port": "health", "protocol": "TCP"}]} in rules
    # nothing secret in the manifests: no certificate or key material, only Secret references and paths
    text = yaml.safe_dump_all(docs)
    assert "BEGIN" not in text and "PRIVATE" not in text


def test_tls_off_renders_no_tls(render):
    docs = render("default")
    for doc in (drafter(docs), verifier(docs), gateway(docs)):
        assert not [k for k in env_of(doc) if "TLS" in k or k == "CROSSDRAFT_HEALTH_PORT"]
        assert not [v for v in _volumes(doc) if v.startswith("tls-")]


def test_tls_without_its_secrets_is_refused_with_the_value_to_set(helm):
    r = _run([helm, "template", RELEASE, str(CHART), "--set", "tls.enabled=true",
              "--set", "tls.modelServerSecret=m"])
    assert r.returncode != 0 and "tls.gatewaySecret is required with tls.enabled" in r.stderr
    r = _run([helm, "template", RELEASE, str(CHART), "--set", "tls.healthPort=0"])
    assert r.returncode != 0 and "healthPort" in r.stderr


# -------------------------------------------------------------------------------- a pool of drafter kinds


POOL_KINDS = ("llama", "tiny-cpu")


def _pool_env(docs) -> dict[str, str]:
    env = env_of(gateway(docs))
    return {k: env[k]["value"] for k in ("CROSSDRAFT_DRAFTER_POOL_SERVICES", "CROSSDRAFT_DRAFTER_POOL") if k in env}


def test_drafters_render_a_deployment_and_service_per_kind(render):
    """Each drafters entry: its own Deployment and headless Service <fullname>-drafter-<name> with its
    model (ConfigMap key drafter-<name>-model), replicas, resources and nodeSelector, the rest from drafter:;
    the gateway gets every kind by name, as Services (discovery) and as static addresses."""
    docs = render("drafters")
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm == {"drafter-model": "qwen2.5-coder-0.5b", "verifier-model": "qwen2.5-coder-1.5b",
                  "drafter-llama-model": POOL_HUB, "drafter-tiny-cpu-model": POOL_CPU}
    llama, tiny = (find(docs, "Deployment", f"{FULL}-drafter-{n}") for n in POOL_KINDS)
    assert (llama["spec"]["replicas"], tiny["spec"]["replicas"], drafter(docs)["spec"]["replicas"]) == (3, 1, 2)
    assert container(llama)["resources"] == {"requests": {"cpu": "3", "memory": "12Gi", "nvidia.com/gpu": 1},
                                             "limits": {"memory": "24Gi", "nvidia.com/gpu": 1}}
    assert container(tiny)["resources"] == {"requests": {"cpu": "4", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    assert pod_spec(llama)["nodeSelector"] == L4_POOL
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(llama)["tolerations"]
    assert "nodeSelector" not in pod_spec(tiny) and "tolerations" not in pod_spec(tiny)  # null / [] = none
    for doc, name, port in ((llama, "llama", 50061), (tiny, "tiny-cpu", 50071)):
        comp = f"drafter-{name}"
        c, env, spec = container(doc), env_of(doc), pod_spec(doc)
        assert c["name"] == "drafter" and c["image"] == container(drafter(docs))["image"]
        assert env["CROSSDRAFT_MODEL"]["valueFrom"]["configMapKeyRef"] == {"name": f"{FULL}-models",
                                                                           "key": f"{comp}-model"}
        assert env["CROSSDRAFT_PORT"]["value"] == str(port)
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": ""}
        assert spec["serviceAccountName"] == f"{FULL}-drafter" and spec["automountServiceAccountToken"] is False
        labels = doc["spec"]["selector"]["matchLabels"]
        assert labels["app.kubernetes.io/component"] == comp  # not "drafter": the drafter's Service skips them
        assert doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == comp
        svc = find(docs, "Service", f"{FULL}-{comp}")["spec"]
        assert svc["clusterIP"] == "None" and svc["selector"] == labels
        assert {p["name"]: p["port"] for p in svc["ports"]} == {"grpc": port, "metrics": 9090}
        (grpc_rule, _) = find(docs, "NetworkPolicy", f"{FULL}-{comp}")["spec"]["ingress"]
        assert grpc_rule["from"] == [{"podSelector": {"matchLabels": _gateway_selector()}}]
    # the entry's fields over the drafter's: a Hub id downloads; a settings block merges key by key
    lenv, tenv = env_of(llama), env_of(tiny)
    assert [i["name"] for i in pod_spec(llama)["initContainers"]] == ["download-model"]
    assert "initContainers" not in pod_spec(tiny)
    assert (lenv["CROSSDRAFT_MAX_BATCH_ROWS"]["value"], lenv["CROSSDRAFT_MAX_BATCH_TOKENS"]["value"]) == ("8", "4096")
    assert (lenv["CROSSDRAFT_DEVICE"]["value"], lenv["CROSSDRAFT_DTYPE"]["value"]) == ("cuda", "bfloat16")
    assert (tenv["CROSSDRAFT_DEVICE"]["value"], tenv["CROSSDRAFT_DTYPE"]["value"]) == ("cpu", "float32")
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert f"{FULL}-drafter-llama" in pdbs and f"{FULL}-drafter-tiny-cpu" not in pdbs  # its pdb.enabled: false
    # the gateway: today's drafter as before, and every kind by name
    env = env_of(gateway(docs))
    assert env["CROSSDRAFT_DRAFTER_SERVICE"]["value"] == f"{FULL}-drafter"
    assert env["CROSSDRAFT_DRAFTER"]["value"] == f"{FULL}-drafter.{NAMESPACE}.svc:50061"
    assert _pool_env(docs) == {
        "CROSSDRAFT_DRAFTER_POOL_SERVICES": f"llama={FULL}-drafter-llama;tiny-cpu={FULL}-drafter-tiny-cpu",
        "CROSSDRAFT_DRAFTER_POOL": (f"llama={FULL}-drafter-llama.{NAMESPACE}.svc:50061;"
                                    f"tiny-cpu={FULL}-drafter-tiny-cpu.{NAMESPACE}.svc:50071"),
    }


def _comparable(doc) -> dict:
    """A manifest less what a drafters entry may change in it: the checksum of the ConfigMaps (a pod
    annotation), the entries' keys in the models ConfigMap and their env in the gateway."""
    doc = copy.deepcopy(doc)
    tmpl = doc.get("spec", {}).get("template", {})
    tmpl.get("metadata", {}).get("annotations", {}).pop("checksum/config", None)
    if doc["kind"] == "ConfigMap":
        doc["data"] = {k: v for k, v in doc["data"].items() if not k.startswith("drafter-") or
                       k in ("drafter-model", "drafter-revision", "drafter-model-file")}
    if doc["kind"] == "Deployment" and doc["metadata"]["name"] == f"{FULL}-gateway":
        c = container(doc)
        c["env"] = [e for e in c["env"] if not e["name"].startswith("CROSSDRAFT_DRAFTER_POOL")]
    return doc


@pytest.mark.parametrize("variant", ["default", "cpu"])
def test_without_drafters_nothing_changes_and_with_them_only_their_objects_are_added(render, helm, variant_files,
                                                                                     variant):
    """drafters: [] (the default) is today's chart: one drafter kind, no pool env. Adding entries adds
    their objects and the gateway's pool env, and leaves every other manifest as it was."""
    base = {(d["kind"], d["metadata"]["name"]): d for d in render(variant)}
    assert not [n for _, n in base if n.startswith(f"{FULL}-drafter-")]
    assert not _pool_env(list(base.values()))
    docs = _template(helm, (*variant_files[variant], *variant_files["drafters"]), K8S_VERSIONS[-1])
    pool = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pdb = {("PodDisruptionBudget", f"{FULL}-drafter-llama")} if variant == "default" else set()
    assert set(pool) - set(base) == {(kind, f"{FULL}-drafter-{n}") for n in POOL_KINDS
                                     for kind in ("Deployment", "Service", "NetworkPolicy")} | pdb
    assert set(base) <= set(pool)
    for key, doc in base.items():
        assert _comparable(pool[key]) == _comparable(doc), key


def test_drafters_with_autoscaling_monitoring_and_a_pinned_drafter(helm, variant_files):
    """HPA and ServiceMonitor per kind when the drafter has them; revision, modelFile and trustRemoteCode
    belong to the drafter's model and are not inherited; without discovery the gateway still names every kind."""
    docs = _template(helm, (*variant_files["drafters"], "--set", "drafter.autoscaling.enabled=true",
                            "--set", "serviceMonitor.enabled=true", "--set", "drafter.revision=v2",
                            "--set", "drafter.trustRemoteCode=true", "--set", "gateway.discovery.enabled=false"),
                     K8S_VERSIONS[-1])
    comps = ["drafter", *(f"drafter-{n}" for n in POOL_KINDS)]
    hpas = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {f"{FULL}-{c}" for c in comps}
    for c in comps:
        assert hpas[f"{FULL}-{c}"]["scaleTargetRef"]["name"] == f"{FULL}-{c}"
        assert "replicas" not in find(docs, "Deployment", f"{FULL}-{c}")["spec"]
    sms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(sms) == {f"{FULL}-{c}" for c in (*comps, "verifier", "gateway")}
    for n in POOL_KINDS:
        sm = sms[f"{FULL}-drafter-{n}"]["spec"]
        assert sm["selector"]["matchLabels"]["app.kubernetes.io/component"] == f"drafter-{n}"
        assert [e["port"] for e in sm["endpoints"]] == ["metrics"]
    cm = find(docs, "ConfigMap", f"{FULL}-models")["data"]
    assert cm["drafter-revision"] == "v2" and not [k for k in cm if k.startswith("drafter-llama-r")]
    assert env_of(drafter(docs))["CROSSDRAFT_REVISION"]["valueFrom"]["configMapKeyRef"]["key"] == "drafter-revision"
    assert "CROSSDRAFT_TRUST_REMOTE_CODE" in env_of(drafter(docs))
    for n in POOL_KINDS:
        env = env_of(find(docs, "Deployment", f"{FULL}-drafter-{n}"))
        assert not {"CROSSDRAFT_REVISION", "CROSSDRAFT_TRUST_REMOTE_CODE"} & set(env), n
    genv = env_of(gateway(docs))
    assert "CROSSDRAFT_DISCOVERY" not in genv and set(_pool_env(docs)) == {"CROSSDRAFT_DRAFTER_POOL_SERVICES",
                                                                         "CROSSDRAFT_DRAFTER_POOL"}
    for d in docs:
        if d["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(d, K8S_VERSIONS[-1], strict=True)


def test_drafters_refused_with_the_value_to_fix(helm):
    """What the schema cannot say: two entries of one name, a Service name past 63 characters."""
    r = _run([helm, "template", RELEASE, str(CHART), "--set",
              "drafters[0].name=a,drafters[0].model=m,drafters[1].name=a,drafters[1].model=n"])
    assert r.returncode != 0 and 'drafters[1].name "a": two drafters entries have this name' in r.stderr
    r = _run([helm, "template", RELEASE, str(CHART), "--set",
              f"fullnameOverride={'f' * 40},drafters[0].name={'k' * 20},drafters[0].model=m"])
    assert r.returncode != 0 and "is longer than 63 characters" in r.stderr, r.stderr


def test_notes_list_the_drafter_kinds(helm, variant_files):
    r = _run([helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
              *variant_files["drafters"]])
    assert r.returncode == 0, r.stderr
    notes = r.stdout.split("NOTES:", 1)[1]
    assert "Drafters : 2 x qwen2.5-coder-0.5b (cuda, bfloat16)" in notes
    assert f"  llama  : 3 x {POOL_HUB} (cuda, bfloat16)" in notes
    assert f"  tiny-cpu: 1 x {POOL_CPU} (cpu, float32)" in notes
