"""The cluster files (``cluster.yaml`` for p4d, ``cluster-p5.yaml`` for p5) pass Ray's own
validation (as ``ray up`` runs it) and launch a cluster the way it must run: EFA attached
(one interface per network card, as AWS documents), the NCCL/EFA environment in every
worker, a node-start check that refuses a node without EFA or the aws-ofi-nccl plugin,
the image of the Dockerfile, code shipped by ``ray job submit --working-dir``, a private
and authenticated cluster, a tracking store (PostgreSQL + S3) that outlives it, and every
value a user must replace marked and listed in docs/cluster.md. The on-premise variant in
docs/cluster.md is validated the same way, so the docs cannot rot.

Everything up to AWS itself runs here: the setup's shell lines run in a shell, with stand-ins
for ``fi_info`` and the plugin library.
"""
from __future__ import annotations

import ipaddress
import re
import stat
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray")
pytest.importorskip("jsonschema")
pytest.importorskip("boto3", reason="Ray's AWS node provider needs boto3 (installed with the test extra)")

from ray.autoscaler._private.aws.config import _configure_from_network_interfaces  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "cluster.md"
CLUSTER_FILES = {"cluster.yaml": ("p4d.24xlarge", 96, 4), "cluster-p5.yaml": ("p5.48xlarge", 192, 32)}
NODE_TYPE_KEYS = ("available_node_types", "head_node_type")


def load(text: str) -> dict:
    raw = yaml.safe_load(text)
    config = prepare_config(raw)  # fills defaults as `ray up` does; validate_config on raw YAML misleads
    validate_config(config)
    return config


@pytest.fixture(scope="module", params=sorted(CLUSTER_FILES), ids=str)
def cluster(request):
    """(file name, its validated config)."""
    return request.param, load((ROOT / request.param).read_text())


@pytest.fixture(scope="module")
def config():
    return load((ROOT / "cluster.yaml").read_text())


def _start_commands(config):
    return config["head_start_ray_commands"] + config["worker_start_ray_commands"]


def _ray_start_lines(config):
    return [c for c in _start_commands(config) if "ray start" in c]


def _node_configs(config):
    return {name: t["node_config"] for name, t in config["available_node_types"].items()}


def test_cluster_is_8_nodes_of_8_gpus(cluster):
    name, config = cluster
    instance, cpus, _ = CLUSTER_FILES[name]
    head = config["available_node_types"][config["head_node_type"]]
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert head["resources"] == {"CPU": cpus, "GPU": 8}
    assert len(workers) == 1 and workers[0]["resources"] == {"CPU": cpus, "GPU": 8}
    assert workers[0]["min_workers"] == workers[0]["max_workers"] == config["max_workers"] == 7
    assert {c["InstanceType"] for c in _node_configs(config).values()} == {instance}


def test_every_node_type_attaches_one_efa_per_network_card(cluster):
    """p4d: 4 EFAs, p5: 32; network cards 0..N-1 once each; the primary interface (card 0,
    device 0) is an EFA with ENA; the others device index 1 (p4d: EFA, p5: EFA-only, as AWS
    documents for p5); subnet and security group on every interface and nowhere else, as Ray
    requires; Ray's own bootstrap step reads them back."""
    name, config = cluster
    _, _, count = CLUSTER_FILES[name]
    for node_type, node in _node_configs(config).items():
        interfaces = node["NetworkInterfaces"]
        assert len(interfaces) == count, node_type
        assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(count))
        for interface in interfaces:
            primary = interface["NetworkCardIndex"] == 0
            assert interface["DeviceIndex"] == (0 if primary else 1)
            wanted = "efa" if primary or name == "cluster.yaml" else "efa-only"
            assert interface["InterfaceType"] == wanted, interface
            assert interface["SubnetId"] == "REPLACE_ME_subnet_id"
            assert interface["Groups"] == ["REPLACE_ME_security_group_id"]
        assert not {"SubnetIds", "SubnetId", "SecurityGroupIds"} & set(node)
    bootstrapped = _configure_from_network_interfaces(config)  # what `ray up` does before launching
    for node in _node_configs(bootstrapped).values():
        assert node["SubnetIds"] == ["REPLACE_ME_subnet_id"] * count
        assert set(node["SecurityGroupIds"]) == {"REPLACE_ME_security_group_id"}


def test_cluster_is_private(cluster):
    _, config = cluster
    assert config["provider"]["use_internal_ips"] is True
    assert "0.0.0.0" not in yaml.safe_dump(config)  # no binding or rule open to the world (comments aside)
    head_start = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert head_start and all("--dashboard-host=127.0.0.1" in c for c in head_start)
    assert not any("--dashboard-port" in c or "--ray-client-server-port" in c for c in _start_commands(config))
    for rule in config["provider"].get("security_group", {}).get("IpPermissions", []):
        for cidr in rule.get("IpRanges", []):
            assert ipaddress.ip_network(cidr["CidrIp"]).is_private


def test_nodes_run_the_image_of_the_dockerfile(cluster):
    """No pip install of torch at boot and no git URL: Ray runs in the image (Python 3.12,
    CUDA torch, libfabric and the plugin), with the host's GPUs, EFA devices and shared storage."""
    _, config = cluster
    docker = config["docker"]
    assert docker["image"] == "REPLACE_ME_image"
    options = " ".join(docker["run_options"])
    for option in ("--gpus all", "--device /dev/infiniband", "--ulimit memlock=-1", "-v /mnt/shared:/mnt/shared"):
        assert option in options
    everything = yaml.safe_dump(config)
    assert "git+" not in everything and "pip install" not in everything
    assert "mpipemoe-venv" not in everything  # the image's environment, on PATH
    assert "FROM ${CUDA_IMAGE}" in (ROOT / "Dockerfile").read_text()


def test_shared_storage_is_mounted_on_every_host(cluster):
    _, config = cluster
    assert any("/mnt/shared" in c and "mount -t nfs4" in c for c in config["initialization_commands"])
    assert "--storage-path /mnt/shared/ray_results" in DOCS.read_text()


def test_every_value_to_replace_is_marked_and_listed_in_the_docs(cluster):
    """Every REPLACE_ME_... of the file appears in docs/cluster.md; no example ID that looks
    real (ami-0123..., subnet-..., fs-...) stands where the user's must go."""
    name, _ = cluster
    text = (ROOT / name).read_text()
    uncommented = "\n".join(line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    marked = set(re.findall(r"REPLACE_ME_\w+", text))
    assert {"REPLACE_ME_region", "REPLACE_ME_ami_id", "REPLACE_ME_subnet_id", "REPLACE_ME_security_group_id",
            "REPLACE_ME_efs_id", "REPLACE_ME_image", "REPLACE_ME_placement_group"} <= marked
    docs = DOCS.read_text()
    missing = sorted(m for m in marked if f"`{m}`" not in docs)
    assert not missing, f"docs/cluster.md does not list {missing}"
    assert not re.search(r"\b(ami|subnet|sg|fs|cr)-[0-9a-f]{8,}", uncommented)
    assert "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id" in text
    assert "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id" in docs


def test_docs_cover_the_workflow():
    docs = DOCS.read_text()
    for step in ("ray up cluster.yaml", "ray job submit", "--working-dir .", "python -m app.cli train --address auto",
                 "mpipemoe sweep", "-L 5000:", "--dashboard-host=127.0.0.1", "ray down cluster.yaml",
                 "docker build", "fi_info -p efa", "all_to_all_perf", "postgresql://", "s3://"):
        assert step in docs, step


def test_on_premise_variant_in_docs_validates():
    docs = DOCS.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", docs, flags=re.S)
    local = [b for b in blocks if "type: local" in b]
    assert len(local) == 1
    config = load(local[0])
    assert config["provider"]["type"] == "local"
    assert all("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"] if "--head" in c)
    assert all("RAY_AUTH_MODE=token" in c for c in _ray_start_lines(config))
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "git+" not in local[0]


def test_ray_token_authentication_is_on(cluster):
    """Every node starts Ray with token auth, from the one token that file_mounts ships from the
    launching machine's home; the token is never part of the repository."""
    _, config = cluster
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
    assert "auth_token" not in tracked and "tracking.env" not in tracked
    assert "auth_token" in (ROOT / ".gitignore").read_text().split()


def test_tracking_server_on_the_head_outlives_the_cluster(cluster):
    """The head serves MLflow with `mpipemoe ui` on its private IP: runs in PostgreSQL, artifacts
    in S3, URIs (and the database password) from a file shipped from the launching machine;
    nothing on the head's disk; drivers, job entrypoints included, log to it over HTTP."""
    _, config = cluster
    servers = [c for c in config["head_start_ray_commands"] if "mpipemoe ui" in c]
    assert len(servers) == 1
    server = servers[0]
    assert re.search(r"--host \$\(hostname -I \| awk '\{print \$1\}'\)", server)  # the private IP
    assert ". $HOME/.mpipemoe/tracking.env" in server
    assert '--tracking-uri "$MLFLOW_BACKEND_STORE_URI"' in server
    assert '--artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION"' in server
    assert "< /dev/null" in server and "server.pid" in server  # detached; restarted by its pid
    assert not any("mpipemoe ui" in c or "mlflow server" in c for c in config["worker_start_ray_commands"])
    assert config["file_mounts"]["~/.mpipemoe/tracking.env"] == "~/.mpipemoe/tracking.env"
    everything = yaml.safe_dump(config)
    assert "sqlite" not in everything and "postgresql://" not in everything  # no store, no password in the file


def _fake_bin(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _fi_info_with(devices: int) -> str:
    """A stand-in for `fi_info -p efa -t FI_EP_RDM` listing ``devices`` EFA devices (each twice,
    as the real one lists a domain once per capability set)."""
    lines = [f"provider: efa\\n    fabric: efa\\n    domain: rdmap{i}s0-rdm\\n    version: 122.0" for i in range(devices)]
    body = "\\n".join(lines * 2)
    return f'[ "$*" = "-p efa -t FI_EP_RDM" ] || exit 2\n' + (f'printf "{body}\\n"\n' if devices else "exit 61\n")


def _efa_checks(config) -> list[str]:
    return [c for c in config["setup_commands"] if "EFA check failed" in c]


def _run_setup_lines(lines, env):
    return [subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True) for line in lines]


def test_node_start_fails_loudly_without_efa_or_the_nccl_plugin(cluster, tmp_path):
    """The setup's EFA lines, run in a shell: a node whose libfabric shows fewer EFA devices than
    the instance has (an interface not attached, no --device), or whose LD_LIBRARY_PATH lacks
    the aws-ofi-nccl plugin, stops the setup with a message naming the cause; a node with
    both passes."""
    name, config = cluster
    _, _, count = CLUSTER_FILES[name]
    checks = _efa_checks(config)
    assert len(checks) == 2
    bin_dir, plugin_dir = tmp_path / "bin", tmp_path / "ofi-nccl"
    bin_dir.mkdir(), plugin_dir.mkdir()
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin", "LD_LIBRARY_PATH": f"/nonexistent:{plugin_dir}"}

    (plugin_dir / "libnccl-net-ofi.so").write_text("")
    _fake_bin(bin_dir, "fi_info", _fi_info_with(count))
    assert [r.returncode for r in _run_setup_lines(checks, env)] == [0, 0]

    _fake_bin(bin_dir, "fi_info", _fi_info_with(count - 1))
    efa, _ = _run_setup_lines(checks, env)
    assert efa.returncode == 1 and f"shows {count - 1} EFA device(s)" in efa.stderr and f"needs {count}" in efa.stderr

    (bin_dir / "fi_info").unlink()  # no libfabric at all
    efa, _ = _run_setup_lines(checks, env)
    assert efa.returncode == 1 and "shows 0 EFA device(s)" in efa.stderr

    (plugin_dir / "libnccl-net-ofi.so").unlink()
    _, plugin = _run_setup_lines(checks, env)
    assert plugin.returncode == 1 and "no aws-ofi-nccl plugin" in plugin.stderr


def test_nccl_efa_settings_reach_the_ray_train_workers(cluster, tmp_path):
    """The setup writes the NCCL/EFA variables to a file that every node's `ray start` line
    sources; Ray Train workers inherit the raylet's environment. Run here in a shell, the
    setup's lines and each start line (with `env` in place of `ray start`) give the workers'
    environment: AWS's EFA settings, and NVLink SHARP left to NCCL (no NCCL_NVLS_ENABLE)."""
    _, config = cluster
    # prepare_config has put the common setup_commands ahead of each node kind's own, as `ray up` runs them
    for setup, starts in ((config["head_setup_commands"], config["head_start_ray_commands"]),
                          (config["worker_setup_commands"], config["worker_start_ray_commands"])):
        home = tmp_path / ("head" if starts is config["head_start_ray_commands"] else "worker")
        home.mkdir()
        _check_node_environment(setup, [c for c in starts if "ray start" in c], {"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert "NCCL_NVLS_ENABLE" not in yaml.safe_dump(config)


def _check_node_environment(setup, starts, shell):
    writes = [c for c in setup if "mpipemoe-nccl.env" in c]
    assert writes and len(starts) == 1
    for line in writes:
        subprocess.run(["bash", "-c", line], env=shell, check=True)
    for line in starts:
        prefix = line.split("ray start")[0].replace("ulimit -n 65536;", "")
        seen = subprocess.run(["bash", "-c", prefix + " env"], env=shell, capture_output=True, text=True,
                              check=True).stdout.splitlines()
        for setting in ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "FI_EFA_FORK_SAFE=1", "NCCL_PROTO=simple",
                        "NCCL_SOCKET_IFNAME=^lo,docker", "RAY_AUTH_MODE=token"):
            assert setting in seen, (setting, line)
        assert not any(s.startswith("NCCL_NVLS_ENABLE") for s in seen)
        # job entrypoints run under the head's raylet: they log to its server
        tracking = [s for s in seen if s.startswith("MLFLOW_TRACKING_URI=")]
        if "--head" in line:
            assert len(tracking) == 1 and re.fullmatch(r"MLFLOW_TRACKING_URI=http://\S+:5000", tracking[0])
        else:
            assert not tracking


def test_the_p5_file_is_the_p4d_file_but_for_its_node_types():
    """cluster-p5.yaml differs from cluster.yaml only in its node types (instance, CPUs, 32 EFAs)
    and the EFA check's device count, so every check above holds for both."""
    p4d, p5 = (load((ROOT / name).read_text()) for name in ("cluster.yaml", "cluster-p5.yaml"))

    def common(config, count):
        rest = {k: v for k, v in config.items() if k not in NODE_TYPE_KEYS}
        for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):  # (Ray merges setup into both)
            rest[key] = [re.sub(rf"\b{count}\b", "N", c).replace("p5.48xlarge", "INSTANCE")
                         .replace("p4d.24xlarge", "INSTANCE") for c in rest[key]]
        return rest

    assert common(p4d, 4) == common(p5, 32)
    p4d_node, p5_node = (next(iter(_node_configs(c).values())) for c in (p4d, p5))
    differ = {k for k in p4d_node.keys() | p5_node.keys() if p4d_node.get(k) != p5_node.get(k)}
    assert differ == {"InstanceType", "NetworkInterfaces"}


def test_the_commented_capacity_reservation_validates_when_uncommented():
    """The capacity reservation is commented out; a user who uncomments it (dropping the
    leading '# ') gets a file Ray accepts."""
    for name in CLUSTER_FILES:
        lines = (ROOT / name).read_text().splitlines()
        reservation = [i for i, line in enumerate(lines) if line.strip().startswith("# CapacityReservationSpecification")]
        assert len(reservation) == 1
        lines[reservation[0]] = lines[reservation[0]].replace("# ", "", 1)
        config = load("\n".join(lines))
        for node in _node_configs(config).values():
            target = node["CapacityReservationSpecification"]["CapacityReservationTarget"]
            assert target["CapacityReservationId"] == "REPLACE_ME_capacity_reservation_id"

