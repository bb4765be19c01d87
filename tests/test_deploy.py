"""deploy/, checked offline as a careful reviewer would: there is no cluster and no container engine here.

The Helm chart is linted and rendered with its default values and each example (helm), every rendered
object is validated against Kubernetes' own schemas (kubernetes-validate --strict), the chart and the
Dockerfile are scanned (checkov), the alert rules are checked and unit-tested (promtool), the KServe
objects are held to what KServe reads from them, and the dashboard's queries are parsed and their
metrics looked for in a running server's /metrics. scripts/test installs the tools into .venv-checks
(scripts/_checks_venv.sh) and .ci/run installs promtool; where one is missing its tests skip, saying so
(in CI, where they must run, they fail instead).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "gpu-share-detect"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
VALUES = {"default": None, **{path.stem: path for path in EXAMPLES}}
NAMESPACE = "gpu-share-detect"
RELEASE = "detect"
RUNTIME = DEPLOY / "kserve" / "cluster-serving-runtime.yaml"
ISVC = DEPLOY / "kserve" / "inference-service.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "gpu-share-detect.json"
TIME_SLICING = DEPLOY / "nvidia" / "time-slicing-config.yaml"
# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Kinds of the Prometheus Operator, whose schemas Kubernetes does not carry: checked field by field below.
CUSTOM_KINDS = {"ServiceMonitor"}
PROBE_ROUTES = {"/readyz", "/healthz", "/v2/health/ready", "/v2/health/live"}


def tool(name: str) -> str:
    """Return the path of a checking tool: .venv-checks first, then PATH; skip (fail in CI) without it."""
    found = shutil.which(name, path=f"{ROOT / '.venv-checks' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        reason = (f"{name} is not installed: scripts/test puts helm, checkov and kubernetes-validate in .venv-checks "
                  "(scripts/_checks_venv.sh); .ci/run installs promtool (Debian's prometheus package)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def run(argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


def helm_template(values: Path | None = None, *sets: str) -> subprocess.CompletedProcess:
    argv = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        argv += ["--values", str(values)]
    for item in sets:
        argv += ["--set", item]
    return run(argv)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Render the chart with the default values and each example: name -> (manifest file, objects)."""
    folder = tmp_path_factory.mktemp("rendered")
    result = {}
    for name, values in VALUES.items():
        out = helm_template(values)
        assert out.returncode == 0, out.stderr
        path = folder / f"{name}.yaml"
        path.write_text(out.stdout)
        result[name] = (path, [doc for doc in yaml.safe_load_all(out.stdout) if doc])
    return result


def objects(rendered, name: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered[name][1] if o["kind"] == kind}


def values_of(name: str) -> dict:
    """The chart's values for one of VALUES, merged as Helm merges them (maps merge, null deletes)."""
    def merge(base, over):
        for key, value in over.items():
            if value is None:
                base.pop(key, None)
            elif isinstance(value, dict) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = value
        return base
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge(values, yaml.safe_load(VALUES[name].read_text())) if VALUES[name] else values


def settings_file(deployment: dict, configmaps: dict) -> tuple[str, dict]:
    """Return the settings file a Deployment's pods read (text and parsed), from its ConfigMap."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    text = configmaps[volumes["settings"]["configMap"]["name"]]["data"]["detect.toml"]
    return text, tomllib.loads(text)


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


# --- The Helm chart -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUES)
def test_helm_lint_passes_strict(name):
    argv = [tool("helm"), "lint", str(CHART), "--strict", "--namespace", NAMESPACE]
    if VALUES[name]:
        argv += ["--values", str(VALUES[name])]
    out = run(argv)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_validates_strictly_against_kubernetes(rendered, version):
    files = [str(path) for path, _ in rendered.values()]
    out = run([tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *files])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    passed = [line for line in lines if line.startswith("INFO") and " passed for resource " in line]
    unknown = [line for line in lines if "Couldn't find schema for kind" in line]
    expected = sum(1 for _, docs in rendered.values() for o in docs if o["kind"] not in CUSTOM_KINDS)
    assert len(passed) == expected, out.stdout
    assert all(re.search(rf"kind ({'|'.join(CUSTOM_KINDS)}) ", line) for line in unknown), unknown


@pytest.mark.parametrize("name", VALUES)
def test_each_group_gets_a_deployment_service_budget_and_settings(rendered, name):
    groups = values_of(name)["groups"]
    expected = {f"{RELEASE}-gpu-share-detect-{group}" for group in groups}
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "ConfigMap"):
        assert set(objects(rendered, name, kind)) == expected, kind
    services = objects(rendered, name, "Service")
    for full, deployment in objects(rendered, name, "Deployment").items():
        pods = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pods.items()
        assert services[full]["spec"]["selector"].items() <= pods.items()
        assert objects(rendered, name, "PodDisruptionBudget")[full]["spec"]["selector"]["matchLabels"].items() <= pods.items()
        http, grpc = services[full]["spec"]["ports"]
        assert http["targetPort"] == container(deployment)["ports"][0]["name"] == "http"
        assert grpc["targetPort"] == container(deployment)["ports"][1]["name"] == "grpc"
        assert grpc["appProtocol"] == "kubernetes.io/h2c"


@pytest.mark.parametrize("name", VALUES)
def test_pods_run_as_the_images_user_with_a_read_only_root_and_only_tmp_writable(rendered, name):
    for deployment in objects(rendered, name, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        ctr = container(deployment)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        assert pod["automountServiceAccountToken"] is False
        security = ctr["securityContext"]
        assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = {m["mountPath"] for m in ctr["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/tmp"} and "emptyDir" in volumes["tmp"]
        env = {e["name"]: e.get("value") for e in ctr["env"]}
        assert env["HOME"].startswith("/tmp") and env["CUDA_CACHE_PATH"].startswith("/tmp")
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(ctr["resources"][kind]), kind


@pytest.mark.parametrize("name", VALUES)
def test_probes_and_the_grace_period_cover_loading_and_draining(rendered, name):
    for deployment in objects(rendered, name, "Deployment").values():
        ctr = container(deployment)
        _, settings = settings_file(deployment, objects(rendered, name, "ConfigMap"))
        assert ctr["startupProbe"]["httpGet"]["path"] in {"/readyz", "/v2/health/ready"}
        # Kubernetes' gRPC probes on grpc.health.v1: "" is /readyz's answer, "liveness" /healthz's.
        grpc_port = container(deployment)["ports"][1]["containerPort"]
        assert ctr["readinessProbe"]["grpc"] == {"port": grpc_port, "service": ""}
        assert ctr["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
        assert settings["grpc_port"] == grpc_port
        startup = ctr["startupProbe"]["periodSeconds"] * ctr["startupProbe"]["failureThreshold"]
        assert startup >= 300, "a model takes minutes to load on a cold node"
        pre_stop = ctr["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > pre_stop + settings.get("shutdown_grace_s", 20.0)


def test_without_a_grpc_port_the_pods_probe_over_http_and_the_service_has_one_port():
    out = helm_template(None, "service.grpcPort=null")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    ctr = container(deployment)
    assert [p["name"] for p in ctr["ports"]] == ["http"]
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz" and ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert 'grpc_port = "off"' in next(iter(configmap["data"].values()))


def test_the_default_pod_asks_for_one_whole_gpu_on_a_node_whose_labels_match_the_budget(rendered):
    (deployment,) = objects(rendered, "default", "Deployment").values()
    assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == 1
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    gpu = values_of("default")["gpu"]
    assert {(e["key"], e["operator"], tuple(e["values"])) for e in term["matchExpressions"]} == {
        ("nvidia.com/gpu.memory", "Gt", (str(gpu["memoryMiB"] - 1),)),
        ("nvidia.com/gpu.replicas", "Lt", (str(gpu["replicasPerGpu"] + 1),)),
    }


@pytest.mark.parametrize("name, resources", [
    ("time-slicing", {"detect": "nvidia.com/gpu.shared"}),
    ("mig", {"objects": "nvidia.com/mig-1g.10gb", "shapes": "nvidia.com/mig-1g.10gb"}),
])
def test_examples_ask_for_a_shared_gpu_or_a_mig_slice(rendered, name, resources):
    for group, resource in resources.items():
        deployment = objects(rendered, name, "Deployment")[f"{RELEASE}-gpu-share-detect-{group}"]
        limits = container(deployment)["resources"]["limits"]
        assert limits[resource] == 1 and not any(k.startswith("nvidia.com/") and k != resource for k in limits)


@pytest.mark.parametrize("name, group, caps, per_gpu, needed, total, share", [
    # Each example's own comment gives these: caps + 1024 MiB overhead per model, times the pods per GPU.
    ("default", "objects", {"objects": "4GiB"}, 1, 5120, 15360, 15360),
    ("time-slicing", "detect", {"faces": "4GiB", "shapes": "1GiB"}, 3, 21504, 23028, 7676),
    ("mig", "objects", {"objects": "8GiB"}, 1, 9216, 9728, 9728),
    ("mig", "shapes", {"shapes": "2GiB"}, 2, 6144, 9728, 4864),
])
def test_each_settings_file_holds_the_models_caps_and_the_pods_share_of_its_gpu(rendered, name, group, caps,
                                                                                per_gpu, needed, total, share):
    deployment = objects(rendered, name, "Deployment")[f"{RELEASE}-gpu-share-detect-{group}"]
    text, settings = settings_file(deployment, objects(rendered, name, "ConfigMap"))
    assert {model: table["gpu_memory"] for model, table in settings["models"].items()} == caps
    assert f"{per_gpu} pod(s) x {needed // per_gpu} MiB" in text and f"= {needed} MiB of {total} MiB" in text
    # The server's own budget then refuses, at run time, a model beyond the pod's share of the GPU.
    assert settings["gpu_total_mib"] == share and settings["gpu_overhead_mib"] == 1024
    assert settings["host"] == "0.0.0.0" and settings["port"] == container(deployment)["ports"][0]["containerPort"]
    if len(caps) == 1:
        assert settings["model"] == f"/srv/detect/models/{next(iter(caps))}" and "model_repository" not in settings
    else:
        assert settings["model_repository"] == "/srv/detect/models" and "model" not in settings


@pytest.mark.parametrize("name", VALUES)
def test_no_detect_variable_of_the_image_can_override_the_settings_file(rendered, name):
    """A DETECT_* variable beats the file and its [models.*] tables: the container drops each one the file sets."""
    for deployment in objects(rendered, name, "Deployment").values():
        ctr = container(deployment)
        _, settings = settings_file(deployment, objects(rendered, name, "ConfigMap"))
        command = ctr["command"]
        assert command[0] == "env" and command[-3:] == ["python3", "-m", "app"]
        assert ctr["args"][:2] == ["serve", "--config"]
        unset = {command[i + 1] for i, word in enumerate(command) if word == "-u"}
        keys = {k for k in settings if k != "models"} | {k for t in settings["models"].values() for k in t}
        # Both of the settings that choose what is served go, whichever of them the file sets.
        assert unset == {f"DETECT_{key.upper()}" for key in keys} | {"DETECT_MODEL", "DETECT_MODEL_REPOSITORY"}
        assert not any(e["name"].startswith("DETECT_") for e in ctr["env"])


@pytest.mark.parametrize("sets, message", [
    (["gpu.replicasPerGpu=4"],
     'group "detect" does not fit its GPU: 4 pods per GPU x (faces 4096 MiB + shapes 1024 MiB + 2 x 1024 MiB '
     'overhead = 7168 MiB) = 28672 MiB, but gpu.memoryMiB is 23028 MiB'),
    (["groups.detect.models.faces.gpu_memory=90%"],
     "(faces 20725 MiB + shapes 1024 MiB + 2 x 1024 MiB overhead = 23797 MiB) = 71391 MiB"),
    (["groups.detect.models.faces.gpu_memory=greedy"],
     'model "faces" is greedy (TensorFlow maps nearly all of the GPU at start) but 3 pods may share its GPU'),
    (["groups.detect.models.faces.gpu_memory=150%"], 'gpu_memory "150%": a share must be above 0% and at most 100%'),
    (["groups.detect.models.faces.gpu_memory=4.5"], 'gpu_memory "4.5": a cap must be a whole number of MiB above 0'),
    (["groups.detect.settings.gpu_total_mib=1000"], 'group "detect": settings.gpu_total_mib is set by the chart'),
    (["terminationGracePeriodSeconds=20"], "terminationGracePeriodSeconds 20 must be above preStopSleepS 5 + "
                                           "shutdown_grace_s 20"),
])
def test_helm_template_fails_naming_the_numbers_when_the_budget_breaks(sets, message):
    out = helm_template(VALUES["time-slicing"], *sets)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("cap, fits", [("8704", True), ("8705", False)])
def test_a_cap_fits_a_mig_slice_only_with_its_overhead(cap, fits):
    """A 9728 MiB slice: 8704 + 1024 MiB fits, 8705 + 1024 MiB does not."""
    out = helm_template(VALUES["mig"], f"groups.objects.models.objects.gpu_memory={cap}")
    if fits:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode != 0 and "(objects 8705 MiB + 1 x 1024 MiB overhead = 9729 MiB) = 9729 MiB, but " \
            "gpu.memoryMiB is 9728 MiB" in out.stderr, out.stderr


@pytest.mark.parametrize("sets, message", [
    (["groups.objects.models.objects.gpu_memory=lots"], "/groups/objects/models/objects/gpu_memory"),
    (["groups.objects.models.objects.max_batch=4"], "additional properties 'max_batch' not allowed"),
    (["gpu.resource=amd.com/gpu"], "/gpu/resource"),
])
def test_the_values_schema_refuses_what_the_service_would(sets, message):
    out = helm_template(None, *sets)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_optional_objects_are_off_by_default(rendered):
    kinds = {o["kind"] for o in rendered["default"][1]}
    assert not kinds & {"ServiceMonitor", "HorizontalPodAutoscaler", "NetworkPolicy"}


def test_all_options_adds_a_service_monitor_an_autoscaler_and_a_network_policy_that_fit_together(rendered):
    full = f"{RELEASE}-gpu-share-detect-objects"
    deployment = objects(rendered, "all-options", "Deployment")[full]
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    service = objects(rendered, "all-options", "Service")[full]

    monitor = objects(rendered, "all-options", "ServiceMonitor")[full]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    hpa = objects(rendered, "all-options", "HorizontalPodAutoscaler")[full]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": full}
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "detect_queue_depth"

    policy = objects(rendered, "all-options", "NetworkPolicy")[full]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pods.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == []
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]
    assert len(ingress["from"]) == 2

    assert container(deployment)["image"].endswith("@" + values_of("all-options")["image"]["digest"])
    assert objects(rendered, "all-options", "PodDisruptionBudget")[full]["spec"] == {
        "minAvailable": 1, "selector": deployment["spec"]["selector"]}


def test_the_time_slicing_example_matches_the_device_plugins_configuration():
    (configmap,) = [d for d in yaml.safe_load_all(TIME_SLICING.read_text()) if d]
    assert configmap["kind"] == "ConfigMap"
    (config,) = [yaml.safe_load(text) for text in configmap["data"].values()]
    assert config["version"] == "v1"
    slicing = config["sharing"]["timeSlicing"]
    (resource,) = slicing["resources"]
    gpu = values_of("time-slicing")["gpu"]
    assert resource["replicas"] == gpu["replicasPerGpu"]
    assert resource["name"] + (".shared" if slicing.get("renameByDefault") else "") == gpu["resource"]
    assert slicing["failRequestsGreaterThanOne"] is True


def test_the_time_slicing_configuration_validates_against_kubernetes():
    out = run([tool("kubernetes-validate"), "--strict", str(TIME_SLICING)])
    assert out.returncode == 0 and " passed for resource configmap/" in out.stdout, out.stdout + out.stderr


def test_checkov_fails_nothing_in_the_chart_and_the_dockerfile_and_names_every_skip(rendered, tmp_path):
    """Every rendering (default values and each example) and the Dockerfile; a skip must say why."""
    folder = tmp_path / "manifests"
    folder.mkdir()
    for path, _ in rendered.values():
        shutil.copy(path, folder / path.name)
    shutil.copy(ROOT / "Dockerfile", folder / "Dockerfile")  # one run for both: checkov starts slowly
    out = run([tool("checkov"), "--skip-download", "--quiet", "--output", "json", "--directory", str(folder),
               "--framework", "kubernetes", "dockerfile"], timeout=300)
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, out.stdout[:2000]
    for report in reports:
        failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"].get("failed_checks", [])]
        assert failed == [], f"{report['check_type']}: {failed}"
        assert report["summary"]["passed"] > 0
        for skipped in report["results"].get("skipped_checks", []):
            reason = skipped.get("check_result", {}).get("suppress_comment", "")
            assert reason and reason != "No comment provided", skipped["check_id"]


# --- KServe ---------------------------------------------------------------------------------------------------


def _one(path: Path) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return doc


def test_the_serving_runtime_has_kserves_required_fields_and_speaks_v2_on_8080():
    runtime = _one(RUNTIME)
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ClusterServingRuntime")
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert {"name": "tensorflow", "version": "2", "autoSelect": False} in spec["supportedModelFormats"]
    assert all(f.get("name") for f in spec["supportedModelFormats"])  # the CRD's one required field
    (ctr,) = spec["containers"]  # the CRD requires containers; KServe runs the one named kserve-container
    assert ctr["name"] == "kserve-container" and ctr["image"]
    env = {e["name"]: e["value"] for e in ctr["env"]}
    assert env["DETECT_PORT"] == "8080" and env["DETECT_HOST"] == "0.0.0.0"
    assert env["DETECT_MODEL_REPOSITORY"] == "/mnt/models" and env["DETECT_MODEL"] == ""
    assert env["DETECT_DEFAULT_MODEL"] == "{{.Name}}"
    assert spec["annotations"]["prometheus.kserve.io/port"] == "8080"
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert ctr[probe]["httpGet"]["port"] == 8080 and ctr[probe]["httpGet"]["path"] in PROBE_ROUTES
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    # Its gRPC port, as KServe's Triton runtime has it: v2 gRPC on 9000, which an InferenceService names h2c.
    assert "grpc-v2" in spec["protocolVersions"]
    assert {e["name"]: e["value"] for e in ctr["env"]}["DETECT_GRPC_PORT"] == "9000"
    assert ctr["securityContext"]["runAsNonRoot"] is True and ctr["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_inference_service_selects_the_runtime_as_kserve_does_and_asks_for_a_gpu():
    runtime, isvc = _one(RUNTIME), _one(ISVC)
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    model = isvc["spec"]["predictor"]["model"]  # the CRD requires spec.predictor
    assert model["runtime"] == runtime["metadata"]["name"]
    # KServe's RuntimeSupportsModel: with a runtime named, every format the runtime lists counts.
    formats = {f"mt:{f['name']}:{f['version']}" for f in runtime["spec"]["supportedModelFormats"]}
    assert f"mt:{model['modelFormat']['name']}:{model['modelFormat']['version']}" in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert model["storageUri"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > 20


def test_the_kserve_containers_validate_strictly_as_kubernetes_containers(tmp_path):
    """KServe's CRDs embed Kubernetes' Container and Volume: hold ours to Kubernetes' own schema."""
    runtime, isvc = _one(RUNTIME), _one(ISVC)
    model = isvc["spec"]["predictor"]["model"]
    pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime"},
         "spec": {"containers": runtime["spec"]["containers"], "volumes": runtime["spec"]["volumes"]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"},
         "spec": {"terminationGracePeriodSeconds": isvc["spec"]["predictor"]["terminationGracePeriodSeconds"],
                  "containers": [{"name": "kserve-container", "image": "x", "env": model["env"],
                                  "resources": model["resources"]}]}},
    ]
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all(pods))
    out = run([tool("kubernetes-validate"), "--strict", str(path)])
    assert out.returncode == 0 and out.stdout.count(" passed for resource pod/") == 2, out.stdout + out.stderr


# --- The service accepts what the deployments give it ---------------------------------------------------------


def _kserve_environ() -> dict[str, str]:
    (ctr,) = _one(RUNTIME)["spec"]["containers"]
    env = {e["name"]: e["value"].replace("{{.Name}}", "objects") for e in ctr["env"] if e["name"].startswith("DETECT_")}
    env.update({e["name"]: e["value"] for e in _one(ISVC)["spec"]["predictor"]["model"]["env"]})
    return env


@pytest.mark.parametrize("name", VALUES)
def test_the_service_accepts_every_settings_file_the_chart_renders(rendered, name, tmp_path):
    from app.settings import load_settings

    for full, deployment in objects(rendered, name, "Deployment").items():
        text, _ = settings_file(deployment, objects(rendered, name, "ConfigMap"))
        path = tmp_path / f"{full}.toml"
        path.write_text(text)
        load_settings(config_path=path, environ={})


def test_the_service_accepts_the_kserve_runtimes_environment():
    from app.settings import load_settings

    settings = load_settings(config_path=ROOT / "config" / "default.toml", environ=_kserve_environ())
    assert settings.port == 8080 and settings.host == "0.0.0.0" and settings.grpc_port == 9000


# --- Alerts ---------------------------------------------------------------------------------------------------


def test_promtool_checks_the_alert_rules():
    out = run([tool("promtool"), "check", "rules", str(ALERTS)])
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_promtool_unit_tests_of_the_alerts_pass():
    out = run([tool("promtool"), "test", "rules", str(ALERT_TESTS)], cwd=ALERT_TESTS.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not():
    alerts = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert {"DetectWorkerRestarting", "DetectModelLoadFailing", "DetectModelMemoryNearCap", "DetectRefusingRequests",
            "DetectSlowRequests"} <= alerts
    cases = [c for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert alerts == fired == quiet


# --- The dashboard --------------------------------------------------------------------------------------------

# Dashboard variables, as Grafana would substitute them, so that promtool can parse the queries.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$job": ".*", "$model": ".+"}
# Exported only where a GPU and NVML are: a server on this machine cannot show them, so the test finds
# each in the service's source instead.
GPU_ONLY_METRICS = {"detect_gpu_memory_used_bytes", "detect_gpu_memory_total_bytes",
                    "detect_model_tensorflow_memory_bytes"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}
TARGET_LABELS = {"job", "instance", "namespace", "pod", "le"}


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def alert_queries() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def substitute(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    return expr


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Return each metric an expression reads, with the label names its matchers use."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    found = []
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", expr):
        name, matchers, call = match.groups()
        if call or name.lower() in PROMQL_WORDS:
            continue
        found.append((name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""))))
    return found


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


def test_the_dashboard_has_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]) for p in panels)
    used = {name for e in dashboard_queries() for name, _ in selectors(e)}
    for metric in ("detect_http_requests_total", "detect_http_request_duration_seconds_bucket", "detect_queue_depth",
                   "detect_images_per_model_call_bucket", "detect_model_memory_bytes", "detect_model_memory_cap_bytes"):
        assert metric in used, metric
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "job", "model"}


def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each query, its variables substituted, as a recording rule: `promtool check rules` parses it."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": substitute(expr)} for i, expr in enumerate(dashboard_queries())]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = run([tool("promtool"), "check", "rules", str(path)])
    assert out.returncode == 0 and f"SUCCESS: {len(dashboard_queries())} rules found" in out.stdout, \
        out.stdout + out.stderr


def test_the_selector_reader_finds_metrics_and_labels_but_not_functions_or_grouping_labels():
    expr = ('histogram_quantile(0.99, sum by (model, le) (rate(detect_x_bucket{job=~"$job", model!=""}[5m])))'
            ' / on (job) group_left max(detect_y) > bool 2')
    assert selectors(expr) == [("detect_x_bucket", {"job", "model"}), ("detect_y", set())]
    assert grouping_labels(expr) == {"model", "le"}


def exported_metrics(text: str) -> dict[str, set[str]]:
    """Return every series name /metrics declares (histogram and counter suffixes spelled out), with its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", ""),
                "gauge": ("",), "untyped": ("",)}
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes[family.type]:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_metric_the_dashboard_the_alerts_and_the_autoscaler_read_is_exported(server, rendered):
    """A running server's /metrics after one /detect; the GPU-only metrics are looked for in app/ instead."""
    from blob_model import blob_image
    from images_for_tests import encode

    status, _, _ = server.request("POST", "/detect", encode(blob_image(32, 32, {})), {"Content-Type": "image/png"})
    assert status == 200
    status, _, body = server.request("GET", "/metrics")
    assert status == 200
    exported = exported_metrics(body.decode())

    hpa = objects(rendered, "all-options", "HorizontalPodAutoscaler")
    queries = dashboard_queries() + alert_queries() + [
        h["spec"]["metrics"][0]["pods"]["metric"]["name"] for h in hpa.values()]
    source = "\n".join(p.read_text() for p in (ROOT / "app").rglob("*.py"))
    missing, wrong_labels = set(), set()
    for expr in queries:
        found = selectors(expr)
        labels_here = set(TARGET_LABELS)
        for name, matchers in found:
            if name in GPU_ONLY_METRICS:
                if f'"{name}"' not in source and f'"{name.removesuffix("_bytes")}' not in source:
                    missing.add(name)
                continue
            if name not in exported:
                missing.add(name)
                continue
            labels_here |= exported[name]
            if exported[name] and not matchers <= exported[name] | TARGET_LABELS:
                wrong_labels.add((name, tuple(sorted(matchers - exported[name] - TARGET_LABELS))))
        if all(name in exported and exported[name] for name, _ in found):
            unknown = grouping_labels(expr) - labels_here
            if unknown:
                wrong_labels.add((expr[:60], tuple(sorted(unknown))))
    assert not missing and not wrong_labels, (
        f"not exported: {sorted(missing)}; labels not on the exported series: {sorted(wrong_labels)}")
