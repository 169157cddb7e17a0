"""The Dockerfile the cluster files run (``docker:`` in cluster*.yaml) installs what the project
pins, and its COPY lines carry everything the package needs: without Docker, the project is
built from exactly the files those lines copy (minus .dockerignore) and imported from that
build, the way the image installs it. Its dependencies are the ones pinned here, checked
against the Makefile and pyproject.toml; the image's own base (CUDA, EFA installer) needs
Docker and the network, so it is built by ``docker build`` on a machine with both
(docs/cluster.md, "Build the image").
"""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in "\n".join(lines).replace("\\\n", " ").splitlines() if i.strip()]


def _pip_specs() -> list[str]:
    """The quoted requirement specs of every `pip install` in the Dockerfile."""
    runs = [i for i in _instructions() if i.startswith("RUN") and "pip install" in i]
    return [spec for run in runs for spec in re.findall(r'"([^"]+)"', run.split("pip install", 1)[1])]


def _copied() -> list[str]:
    """The build-context paths the COPY lines take."""
    sources = []
    for instruction in _instructions():
        if instruction.startswith("COPY "):
            sources += instruction.split()[1:-1]
    return sources


def test_torch_is_the_makefiles_pin_and_the_extras_are_the_projects():
    specs = _pip_specs()
    torch_pin = re.search(r"^TORCH_PIN := (\S+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    assert torch_pin in specs
    projects = [s for s in specs if s.startswith(".[")]
    assert len(projects) == 1
    extras = projects[0][2:-1].split(",")
    declared = PROJECT["project"]["optional-dependencies"]
    assert set(extras) == {"ray", "cluster", "tracking-server", "system-metrics"} and set(extras) <= set(declared)
    # what the nodes must agree on is pinned exactly (Ray across nodes, MLflow with the server)
    pinned = {re.split(r"[\[=<>]", spec)[0]: spec for extra in extras for spec in declared[extra]}
    for name in ("ray", "mlflow", "boto3", "psycopg"):
        assert "==" in pinned[name], pinned[name]


def test_the_image_has_python_3_11_or_later_and_the_efa_libraries_on_its_paths():
    """Ubuntu 24.04's Python 3.12: tomllib reads `--config` and `--space` TOML files there as here."""
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", DOCKERFILE, flags=re.M).group(1)
    assert base.startswith("nvidia/cuda:") and base.endswith("-ubuntu24.04")
    assert "efa_installer.sh" in DOCKERFILE and "--skip-kmod" in DOCKERFILE
    paths = dict(re.findall(r"^ENV (PATH|LD_LIBRARY_PATH)=(\S+)$", DOCKERFILE, flags=re.M))
    assert "/opt/amazon/efa/bin" in paths["PATH"].split(":")           # fi_info, for the node-start check
    assert "/opt/amazon/ofi-nccl/lib" in paths["LD_LIBRARY_PATH"].split(":")  # the aws-ofi-nccl plugin


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_the_copy_lines_carry_every_package_and_none_is_ignored():
    packages = {p.rstrip("*") for p in PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(_copied())
    assert packages | {"pyproject.toml", PROJECT["project"]["readme"]} <= copied
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not [path for path in copied if _ignored(path, patterns)]
    assert _ignored("results", patterns) and _ignored(".git", patterns)  # the context stays small


def test_the_project_builds_from_the_copied_files_and_imports(tmp_path):
    """What `pip install .[...]` does in the image, with the dependencies this environment has:
    build the package from a context of only the COPY'd files, install it into a folder of its
    own, and import its entry points from there (not from this checkout)."""
    context, target = tmp_path / "context", tmp_path / "site"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source in _copied():
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=ignore)
        else:
            shutil.copy2(path, context / source)
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(context)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    probe = ("import app, app.cli, app.tracking.server, workers.loop, moe_engine, lm, moe_sim, tune_spaces; "
             "print(app.__file__)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target), "HOME": str(tmp_path)}
    imported = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert imported.stdout.strip().startswith(str(target))
    usage = subprocess.run([sys.executable, "-m", "app.cli", "ui", "--help"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert usage.returncode == 0 and "--artifacts-destination" in usage.stdout
