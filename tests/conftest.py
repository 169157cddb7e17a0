"""Shared pytest fixtures.

The tests mirror the source tree (tests/moe_engine/, tests/moe_sim/, tests/lm/,
tests/workers/, tests/app/); the helpers every test imports (conftest.py, distributed.py,
engine_cases.py, processes.py) stay here. Tiers are markers (pyproject.toml): ``gloo``
(spawns gloo rank processes), ``ray``, ``soak``, ``faults``, ``gpu``; unmarked tests are
unit tests.

``ray_local`` starts one embedded Ray instance for the whole session, sized for a
2-core CI machine (two ``ray.init`` calls with different
settings in one process conflict, and a stale ``ray_current_cluster`` file makes a
later ``ray.init`` try to reach a dead cluster). Tests that need their own Ray
cluster (e.g. ``ray.cluster_utils.Cluster``) run it in a subprocess. ``pytest_configure``
gives every Ray Train job of the session the quick start-up settings of an embedded sweep.
"""
from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """An embedded local Ray instance: 2 CPUs, no dashboard, ~300 MB object store."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # Short temp path: Ray's socket paths have a length limit.
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=300 * 1024 * 1024, _temp_dir=temp_dir,
             log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def pytest_configure(config):
    """Every Ray Train job of the session (in this process, in the ``mpipemoe`` subprocesses the
    tests start, in Tune trials) gets the standard Ray Train settings that an embedded sweep
    gives its trials (``app.jobs.ray_start.LOCAL_RAY_TRAIN_ENV``, docs/sweeps.md): the controller
    checks its workers every 0.5 s, not 2 s (a job's start, each checkpoint report and its end
    wait for such a check), and no preemption watcher process. Set before any Ray starts, so
    Ray's processes and the subprocesses inherit them; values set outside pytest win. Measured
    on 2 cores: a 2-worker job with two checkpoint reports spent 1.6 s, not 6.1 s, between its
    first step and its end."""
    from app.jobs.ray_start import local_train_env

    os.environ.update(local_train_env())


# The modules that take longest on 2 cores, longest first (each starts minutes of Ray Train
# jobs: a local cluster of three nodes; a dozen 2-worker jobs; the docs' four `mpipemoe train`
# runs; three runs signalled mid-step; a sweep; ...). `make test` hands whole modules to its two
# test processes in collection order (`--dist loadfile --no-loadscope-reorder`): these start
# first, and the many short modules fill in behind them, so neither process idles for minutes at
# the end while the other finishes a long module (xdist's default order, most tests first,
# started these few-test modules last). A module missing here only runs later; the order never
# changes what a test checks.
LONGEST_MODULES_FIRST = (
    "tests/app/test_cluster_jobs.py",
    "tests/app/test_train_ray.py",
    "tests/test_docs.py",
    "tests/app/test_faults.py",
    "tests/app/test_sweep.py",
    "tests/workers/test_faults_checkpoint.py",
    "tests/app/test_tracking_server.py",
    "tests/app/test_train_expert_parallel.py",
    "tests/app/test_faults_cli.py",
    "tests/app/test_faults_issue39.py",
    "tests/moe_engine/test_engine_reference.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (``LONGEST_MODULES_FIRST``; a stable sort, so each module keeps
    its own order); GPU tests (marker `gpu`) are skipped where CUDA is absent."""
    import torch

    def module_rank(item) -> int:
        module = item.nodeid.split("::", 1)[0]
        return LONGEST_MODULES_FIRST.index(module) if module in LONGEST_MODULES_FIRST else len(LONGEST_MODULES_FIRST)

    items.sort(key=module_rank)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def grad_mode_is_left_as_found():
    """A test (or the code it calls in-process, such as a CLI command) that leaves autograd
    switched off would fail every later test that needs gradients, far from the cause:
    fail the test that did it instead, and restore the mode."""
    import torch

    before = torch.is_grad_enabled()
    yield
    after = torch.is_grad_enabled()
    torch.set_grad_enabled(before)
    assert after == before, f"the test left torch.is_grad_enabled() {after} (it was {before})"
