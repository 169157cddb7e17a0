"""``cluster.yaml`` passes Ray's own validation (as ``ray up`` runs it) and keeps the cluster
private and reproducible: internal IPs, dashboard on 127.0.0.1, no open CIDR, 8 x 8 GPUs,
pinned installs that match pyproject.toml. The on-premise variant in docs/cluster.md is
validated the same way, so the docs cannot rot.
"""
from __future__ import annotations

import ipaddress
import re
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray")
pytest.importorskip("jsonschema")

from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load(text: str) -> dict:
    raw = yaml.safe_load(text)
    config = prepare_config(raw)  # fills defaults as `ray up` does; validate_config on raw YAML misleads
    validate_config(config)
    return config


@pytest.fixture(scope="module")
def config():
    return load((ROOT / "cluster.yaml").read_text())


def _start_commands(config):
    return config["head_start_ray_commands"] + config["worker_start_ray_commands"]


def test_cluster_is_8_nodes_of_8_gpus(config):
    head = config["available_node_types"][config["head_node_type"]]
    workers = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    assert head["resources"]["GPU"] == 8
    assert len(workers) == 1 and workers[0]["resources"]["GPU"] == 8
    assert workers[0]["min_workers"] == workers[0]["max_workers"] == config["max_workers"] == 7
    assert head["node_config"]["InstanceType"] == workers[0]["node_config"]["InstanceType"] == "p4d.24xlarge"


def test_cluster_is_private(config):
    assert config["provider"]["use_internal_ips"] is True
    assert "0.0.0.0" not in yaml.safe_dump(config)  # no binding or rule open to the world (comments aside)
    head_start = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert head_start and all("--dashboard-host=127.0.0.1" in c for c in head_start)
    assert not any("--dashboard-port" in c or "--ray-client-server-port" in c for c in _start_commands(config))
    # every node type brings its own security group: Ray's auto-created one opens SSH to the world
    for node_type in config["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"]
    for rule in config["provider"].get("security_group", {}).get("IpPermissions", []):
        for cidr in rule.get("IpRanges", []):
            assert ipaddress.ip_network(cidr["CidrIp"]).is_private


def _pins(spec_list) -> dict:
    """{'ray': '2.60.0', ...} from requirement strings like 'ray[train,tune]==2.60.0'."""
    pins = {}
    for spec in spec_list:
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;]+)", spec)
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def test_setup_installs_pinned_versions_matching_the_project(config):
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = _pins(project["project"]["optional-dependencies"]["ray"])
    installed = _pins(spec for command in config["setup_commands"] for spec in re.findall(r'"([^"]+)"', command))
    for name in ("ray", "mlflow"):
        assert installed[name] == wanted[name], f"cluster.yaml pins {name} {installed[name]}, pyproject {wanted[name]}"
    assert "torch" in installed
    project_install = [c for c in config["setup_commands"] if "mpipemoe[ray] @ git+" in c]
    assert len(project_install) == 1 and re.search(r"\.git@[\w.-]+", project_install[0])  # a pinned ref


def test_shared_storage_is_mounted_everywhere(config):
    assert any("/mnt/shared" in c and "mount" in c for c in config["setup_commands"])
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert "--storage-path /mnt/shared/ray_results" in docs


def test_docs_cover_the_workflow():
    docs = (ROOT / "docs" / "cluster.md").read_text()
    for step in ("ray up cluster.yaml", "mpipemoe train --address auto", "mpipemoe sweep",
                 "-L 5000:127.0.0.1:5000", "--dashboard-host=127.0.0.1", "ray down cluster.yaml"):
        assert step in docs, step


def test_on_premise_variant_in_docs_validates():
    docs = (ROOT / "docs" / "cluster.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", docs, flags=re.S)
    local = [b for b in blocks if "type: local" in b]
    assert len(local) == 1
    config = load(local[0])
    assert config["provider"]["type"] == "local"
    assert all("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"] if "--head" in c)
    assert all("RAY_AUTH_MODE=token" in c for c in _ray_start_lines(config))
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}


def _ray_start_lines(config):
    return [c for c in _start_commands(config) if "ray start" in c]


def test_ray_token_authentication_is_on(config):
    """Every node starts Ray with token auth, from the one token that file_mounts ships from the
    launching machine's home; the token is never part of the repository."""
    starts = _ray_start_lines(config)
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token" in c.split("ray start")[0] for c in starts)
    mounts = config["file_mounts"]
    assert mounts.get("~/.ray/auth_token") == "~/.ray/auth_token"  # remote: local, outside the repo
    for local in mounts.values():
        assert local.startswith("~/") or not Path(local).resolve().is_relative_to(ROOT)
    setup = config["setup_commands"]
    assert setup[0].startswith("test -s ~/.ray/auth_token ||") and "exit 1" in setup[0]  # refuse, don't run open
    assert "chmod 600 ~/.ray/auth_token" in setup
    assert any("export RAY_AUTH_MODE=token" in c for c in setup)  # shells (ray job submit) agree
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "auth_token" not in tracked
    assert "auth_token" in (ROOT / ".gitignore").read_text().split()


def test_mlflow_tracking_server_on_the_head(config):
    """The head runs MLflow: private IP only, SQLite on the head's own disk (one writer, no
    SQLite on NFS), artifacts on the shared file system; drivers there log over HTTP."""
    servers = [c for c in config["head_start_ray_commands"] if "mlflow server" in c]
    assert len(servers) == 1
    server = servers[0]
    assert re.search(r"--host \$\(hostname -I \| awk '\{print \$1\}'\)", server)  # the private IP
    assert re.search(r"--backend-store-uri sqlite:///\$HOME/", server)
    assert "--artifacts-destination /mnt/shared/" in server
    assert "< /dev/null" in server and "server.pid" in server  # detached; restarted by its pid
    assert not any("mlflow server" in c for c in config["worker_start_ray_commands"])
    uri = [c for c in config["head_setup_commands"] if "MLFLOW_TRACKING_URI" in c]
    assert len(uri) == 1 and "http://$(hostname -I" in uri[0] and ":5000" in uri[0]
    everything = yaml.safe_dump(config)
    assert "sqlite:////mnt/shared" not in everything  # no SQLite store on NFS/EFS
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert "sqlite:////mnt/shared" not in docs and "ray get-auth-token --generate" in docs


def test_nccl_efa_settings_reach_the_ray_train_workers(config, tmp_path):
    """The setup writes the NCCL/EFA variables to a file that every node's `ray start` line
    sources; Ray Train workers inherit the raylet's environment. Run here in a shell, the
    setup's line and each start line (with `env` in place of `ray start`) give the workers'
    environment."""
    writes = [c for c in config["setup_commands"] if "mpipemoe-nccl.env" in c]
    assert len(writes) == 1
    shell = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", "-c", writes[0]], env=shell, check=True)
    for line in _ray_start_lines(config):
        prefix = line.split("$HOME/mpipemoe-venv/bin/ray start")[0].replace("ulimit -n 65536;", "")
        seen = subprocess.run(["bash", "-c", prefix + " env"], env=shell, capture_output=True, text=True,
                              check=True).stdout.splitlines()
        for setting in ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "NCCL_SOCKET_IFNAME=^lo,docker",
                        "RAY_AUTH_MODE=token"):
            assert setting in seen, (setting, line)


def test_venv_package_is_installed_on_ubuntu_22_04(config):
    venv = [i for i, c in enumerate(config["setup_commands"]) if "python3 -m venv" in c]
    apt = [i for i, c in enumerate(config["setup_commands"]) if "apt-get install" in c and "python3.10-venv" in c]
    assert venv and apt and apt[0] < venv[0]


CLUSTER_FILES = sorted(ROOT.glob("cluster*.yaml"))
NODE_TYPE_KEYS = ("available_node_types", "head_node_type")


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda path: path.name)
def test_every_cluster_file_passes_rays_validation(path):
    assert load(path.read_text())["max_workers"] == 7


def test_the_p5_file_is_the_p4d_file_but_for_its_node_types():
    """cluster-p5.yaml (H100 nodes) differs from cluster.yaml only in the node types, so every
    check above (privacy, pinning, token, EFA environment, venv) holds for it too."""
    p4d, p5 = (load((ROOT / name).read_text()) for name in ("cluster.yaml", "cluster-p5.yaml"))
    assert {k: v for k, v in p4d.items() if k not in NODE_TYPE_KEYS} == \
        {k: v for k, v in p5.items() if k not in NODE_TYPE_KEYS}
    for node_type in p5["available_node_types"].values():
        assert node_type["node_config"]["InstanceType"] == "p5.48xlarge" and node_type["resources"]["CPU"] == 192
        p4d_node = next(iter(p4d["available_node_types"].values()))["node_config"]
        assert {k: v for k, v in node_type["node_config"].items() if k != "InstanceType"} == \
            {k: v for k, v in p4d_node.items() if k != "InstanceType"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda path: path.name)
def test_the_commented_container_image_and_capacity_reservation_validate_when_uncommented(path):
    """The optional `docker:` section and the capacity reservation are commented out; a user
    who uncomments them (dropping the leading '# ') gets a file Ray accepts."""
    lines = path.read_text().splitlines()
    start = lines.index("# docker:")
    block = [start] + [i for i in range(start + 1, len(lines)) if lines[i].startswith("#   ")
                       and all(lines[j].startswith("#   ") for j in range(start + 1, i + 1))]
    reservation = [i for i, line in enumerate(lines) if line.strip().startswith("# CapacityReservationSpecification")]
    assert len(reservation) == 1
    for i in block + reservation:
        lines[i] = lines[i].replace("# ", "", 1)
    config = load("\n".join(lines))
    assert config["docker"]["image"].endswith("mpipemoe:0.1.0") and config["docker"]["run_options"]
    node = next(iter(config["available_node_types"].values()))["node_config"]
    assert node["CapacityReservationSpecification"]["CapacityReservationTarget"]["CapacityReservationId"]
