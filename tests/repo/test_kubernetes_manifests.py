"""deploy/kubernetes/: every file is valid against the Kubernetes API schemas (``kubernetes-validate``, strict:
an unknown field fails), and the manifests agree with the code they run — the probes ask the paths the
listeners answer on the ports the ConfigMap's config listens on, the grace period covers the stop the config
bounds, the startup probe covers a load and the slot restores, the ConfigMap's TOML loads with llama-guard's
own loader and turns the GPU reset off.

``kubernetes_validate`` is imported at the top: a missing validator fails the run (it is a dev dependency,
pyproject.toml), it never skips.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from llama_guard.config import Config, load_config
from llama_guard.config.argv import slot_save_dir
from llama_guard.front.source import CLOSE_TIMEOUT_S
from llama_guard.model.params import params_from
from llama_guard.status.health import HEALTH_PATHS
from llama_guard.upgrade.kept import builds_dir
from llama_guard.vocab.units import MIB

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
FILES = sorted(p for p in KUBE.iterdir() if p.is_file())
# The oldest Kubernetes release the manifests are for (preStop's sleep action is there from 1.29) and the
# newest schema the validator ships.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
GIB = 1024 ** 3
MODEL_BYTES = 16 * GIB  # the model the timings are for: a 16 GB GGUF
COLD_READ_BYTES_PER_S = 100e6  # a cold read from a network volume


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently, the
    API server's strict decoding refuses it)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise yaml.constructor.ConstructorError(None, None, f"keys given twice: {twice}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(path.read_text(), Loader=StrictLoader) if d is not None]


def resources() -> dict[str, dict[str, Any]]:
    """Every manifest by kind (one of each kind is shipped)."""
    found: dict[str, dict[str, Any]] = {}
    for path in FILES:
        for doc in documents(path):
            assert doc["kind"] not in found, f"{path.name}: a second {doc['kind']}"
            found[doc["kind"]] = doc
    return found


@pytest.fixture(scope="module")
def kinds() -> dict[str, dict[str, Any]]:
    return resources()


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kinds: dict[str, dict[str, Any]]) -> Config:
    """The ConfigMap's llama-guard.toml through :func:`load_config`, with the container's environment."""
    for key in list(os.environ):
        if key.startswith("LLAMA_GUARD_") or key == "STATE_DIRECTORY":
            monkeypatch.delenv(key)
    for item in container(kinds).get("env", []):
        monkeypatch.setenv(item["name"], item["value"])
    path = tmp_path / "llama-guard.toml"
    path.write_text(kinds["ConfigMap"]["data"]["llama-guard.toml"])
    return load_config(path)


def pod(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = kinds["Deployment"]["spec"]["template"]["spec"]
    return spec


def container(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = pod(kinds)["containers"]
    return dict(only)


def test_the_manifests_are_there() -> None:
    assert {p.name for p in FILES} >= {"configmap.yaml", "deployment.yaml", "service.yaml"}
    assert all(p.suffix == ".yaml" for p in FILES), "only manifests: the test validates every file"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_file_is_valid_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no manifest"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_the_validator_refuses_a_misspelt_field(kinds: dict[str, dict[str, Any]]) -> None:
    """The check above can fail: strict validation refuses a field the API does not have."""
    bad = copy.deepcopy(kinds["Deployment"])
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 240
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def test_the_lint_refuses_a_key_given_twice(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text("kind: Service\nmetadata:\n  name: a\n  name: b\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="keys given twice"):
        documents(twice)


def test_one_gpu_per_replica_and_the_foreground_run(kinds: dict[str, dict[str, Any]]) -> None:
    c = container(kinds)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["command"][:2] == ["llama-guard", "run"]
    config_dir = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    assert c["command"][2:] == ["--config", f"{config_dir}/llama-guard.toml"]
    assert kinds["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no second pod for a GPU


def test_probes_ask_the_health_paths_on_a_port_that_serves_them(kinds: dict[str, dict[str, Any]],
                                                                 config: Config) -> None:
    c = container(kinds)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = {config.metrics.address[1] if config.metrics.address else None,
              *(port for _, port in config.front.addresses)}
    expected = {"livenessProbe": "/livez", "readinessProbe": "/readyz", "startupProbe": "/readyz"}
    for probe, path in expected.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path and path in HEALTH_PATHS
        assert ports[get["port"]] in served, f"{probe} asks port {get['port']}, where llama-guard does not listen"
    # Each listener listens on the pod's address, on the port the container declares.
    assert ports["http"] == config.front.addresses[0][1] and config.front.addresses[0][0] == "0.0.0.0"
    assert config.metrics.address == ("0.0.0.0", ports["metrics"])
    assert config.server.host == "127.0.0.1" and config.server.port not in ports.values()  # llama-server stays private


def test_the_service_and_the_scrape_annotations_name_the_declared_ports(kinds: dict[str, dict[str, Any]]) -> None:
    c = container(kinds)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    service = kinds["Service"]["spec"]
    assert service["selector"].items() <= kinds["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["ports"]} <= ports.keys()
    notes = kinds["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == ports["metrics"]


def test_the_grace_period_covers_the_drain_and_the_slot_saves(kinds: dict[str, dict[str, Any]],
                                                              config: Config) -> None:
    params = params_from(config)
    assert params.exit_drain_s == config.front.stop_drain_s > 0  # the front door drains on SIGTERM
    pre_stop = container(kinds)["lifecycle"]["preStop"]["sleep"]["seconds"]
    stop = (pre_stop + params.exit_drain_s + config.slots.save_timeout_s + config.recovery.stop_grace_s
            + params.kill_wait_s + CLOSE_TIMEOUT_S)
    grace = pod(kinds)["terminationGracePeriodSeconds"]
    assert grace >= stop, f"terminationGracePeriodSeconds {grace} < the stop's bound {stop} s"
    assert grace - stop <= 60, "a grace period far above the stop's bound only delays a node drain"


def test_the_startup_probe_covers_a_16_gb_load_and_the_slot_restores(kinds: dict[str, dict[str, Any]],
                                                                      config: Config) -> None:
    assert config.health.load_timeout_s >= MODEL_BYTES / COLD_READ_BYTES_PER_S + 30
    probe = container(kinds)["startupProbe"]
    budget = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget >= config.health.load_timeout_s + config.slots.restore_timeout_s + probe["periodSeconds"]


def test_no_gpu_reset_and_least_privilege(kinds: dict[str, dict[str, Any]], config: Config) -> None:
    """The node's operators own GPU resets: none is ever triggered, and the pod could not run one (no root, no
    capability: the Pod Security Standard "restricted")."""
    assert config.recovery.reset_on == []
    assert not params_from(config).reset_on
    assert config.gpu.enable_persistence is False
    assert config.server.user == "" and config.gpu.require_server_on_gpu is False
    spec, c = pod(kinds), container(kinds)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "privileged" not in c["securityContext"] and "hostPID" not in spec


def test_the_state_directory_holds_the_slot_files_and_the_kept_builds(kinds: dict[str, dict[str, Any]],
                                                                      config: Config) -> None:
    c = container(kinds)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    state = Path(mounts["state"])
    assert slot_save_dir(config.server, config.slots, config.runtime).parent == state
    assert builds_dir(config.runtime.dir).parent == state
    assert str(config.runtime.dir) == mounts["runtime"]
    volume = next(v for v in pod(kinds)["volumes"] if v["name"] == "state")
    size = volume["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and int(size[:-2]) * GIB > config.slots.budget_mib * MIB  # never evicted for slots
