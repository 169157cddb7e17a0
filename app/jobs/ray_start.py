"""A job on Ray: starting embedded local Ray or joining a cluster (``init_ray``), with Ray's token
file kept private (``private_ray_token``) and embedded Ray's Train settings
(``LOCAL_RAY_TRAIN_ENV``); the ``TorchTrainer`` of a job (``build_trainer``:
GPUs when the cluster has them, expert groups of one GPU node); the check that the cluster
holds all its workers at once (``check_resources``).

Ray (the ``ray`` extra) is imported inside these functions: importing it costs seconds.
"""
from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from app.jobs.job import TrainJob, expert_degree, worker_config
from workers.loop import train_fn_per_worker


# Standard Ray Train settings for the Train jobs on embedded local Ray (one node, this machine:
# `mpipemoe train` and a study's trials), where the user has not set them. Each of the
# controller's state changes waits for its next check on the workers (default every 2 s),
# and each job starts a preemption watcher, one more process, while a local node is never
# drained. Measured on 2 shared cores, an lr-study trial's Train job (40 steps, ~1.5 s of
# training), start to end: 13-15 s with these, 13-20 s without (docs/sweeps.md).
LOCAL_RAY_TRAIN_ENV: Mapping[str, str] = MappingProxyType(
    {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"})


def local_train_env(environ=None) -> dict[str, str]:
    """``LOCAL_RAY_TRAIN_ENV`` less the variables set in ``environ`` (default ``os.environ``):
    the user's own values win. ``init_ray`` and a sweep give them to embedded Ray's job
    (``runtime_env``); Ray Train passes them on to each job's controller and workers."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in LOCAL_RAY_TRAIN_ENV.items() if k not in environ}


def init_ray(job: TrainJob, address: str | None = None, verbose: bool = False) -> bool:
    """Start embedded local Ray (or connect to ``address``) unless Ray is up; True if started.

    ``verbose`` forwards the Ray actors' own logs (worker tracebacks, Ray Train's
    controller) to this terminal; otherwise only our progress lines and errors show.
    """
    import ray

    if ray.is_initialized():
        return False
    private_ray_token(create=not address)
    # Ray's start-up warnings (e.g. that token authentication is on) are not the user's
    # business on a quiet run: the only stderr line is ours; --verbose shows them.
    level = "WARNING" if verbose else "ERROR"
    if address:
        ray.init(address=address, logging_level=level, log_to_driver=verbose)
    else:
        cpus = job.cpus_per_worker or 0.9
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(job.num_workers * cpus)),
                 include_dashboard=False, dashboard_host="127.0.0.1",
                 object_store_memory=300 * 2**20, logging_level=level, log_to_driver=verbose,
                 runtime_env={"env_vars": local_train_env()})
    return True


def private_ray_token(create: bool) -> Path | None:
    """Keep Ray's token private. Ray 2.60 turns token authentication on for a new local
    cluster and, when no token exists, writes ``~/.ray/auth_token`` with the process umask
    (0644 in a 0755 folder: any local user could read the credential of the cluster). So,
    with ``create`` (embedded Ray) and no token yet, write it ourselves first: the folder 0700
    when we create it, the file 0600 (a random 256-bit hex token, as Ray makes). A token file
    of ours that others may read is made 0600. Nothing is done where the token comes from
    elsewhere (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``) or authentication is off
    (``RAY_AUTH_MODE``). Returns the token file, or None."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" \
            or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    folder = Path.home() / ".ray"
    token = folder / "auth_token"
    try:
        if create and not token.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32))
        elif token.is_file() and token.stat().st_uid == os.getuid() and token.stat().st_mode & 0o077:
            token.chmod(0o600)
    except FileExistsError:  # another job wrote it first
        pass
    except OSError:  # a read-only home: Ray says what it needs
        return None
    return token


def _only_this_machine() -> bool:
    """Whether the Ray this process is connected to is one node on this machine (an
    embedded instance started earlier in this process: a notebook's, a test session's)."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    return len(nodes) == 1 and nodes[0]["NodeManagerAddress"] == ray.util.get_node_ip_address()


def check_resources(scaling_config, nodes: list[dict]) -> None:
    """Raise ValueError naming the fix unless ``nodes`` (each node's total resources, as in
    ``ray.nodes()``) can hold all workers of ``scaling_config`` at once. Without this check
    Ray Train waits for the missing resources forever."""
    need = scaling_config.resources_per_worker or {}
    workers = scaling_config.num_workers
    fits = sum(min(int(node.get(key, 0) / amount + 1e-6) for key, amount in need.items() if amount > 0)
               for node in nodes) if need else workers
    if fits < workers:
        have = {key: sum(node.get(key, 0) for node in nodes) for key in need}
        per_worker = ", ".join(f"{amount:g} {key}" for key, amount in need.items())
        totals = ", ".join(f"{amount:g} {key}" for key, amount in have.items())
        hint = "or --no-gpu" if need.get("GPU") else "or a smaller --cpus-per-worker"
        raise ValueError(f"TrainJob.num_workers={workers} is invalid: the Ray cluster ({len(nodes)} node(s), "
                         f"{totals}) holds {fits} worker(s) of {per_worker} each; use --num-workers {max(fits, 1)} "
                         f"{hint}, or add nodes")


def build_trainer(job: TrainJob, metrics_queue=None, train_fn=None, extra_config: dict | None = None,
                  stop_flag=None):
    """The ``TorchTrainer`` of ``job`` (does not call ``ray.init``; data must be prepared).

    ``train_fn`` (default ``workers.loop.train_fn_per_worker``) runs in each worker with
    ``worker_config(job)`` updated by ``extra_config``.
    """
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    use_gpu = _resolve_gpu(job)
    gpus_per_node = _gpus_per_node() if use_gpu else None
    if job.expert_parallel is None:  # the default degree, now that the GPUs of a node are known
        degree = expert_degree(job, gpus_per_node)
        job.model_preset().check_world_size(job.num_workers, None if degree == job.num_workers else degree)
        job.check_peer_partitions(degree)
    config = worker_config(job, use_gpu, metrics_queue, gpus_per_node).replace(
        stop_flag=stop_flag, **(extra_config or {}))
    resources = {"CPU": config.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    return TorchTrainer(
        train_fn or train_fn_per_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=job.collective_timeout_s),
        scaling_config=ray.train.ScalingConfig(num_workers=job.num_workers, use_gpu=use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=job.name, storage_path=job.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=job.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.keep_checkpoints or None)),
    )


def _resolve_gpu(job: TrainJob) -> bool:
    if job.use_gpu is not None:
        return job.use_gpu
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= 1
    return torch.cuda.is_available()


def _gpus_per_node() -> int | None:
    """The GPUs of the smallest GPU node of the connected Ray cluster (None: none, or Ray is
    not up): the default expert group's size."""
    import ray

    if not ray.is_initialized():
        return None
    gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]
    return min(gpus) if gpus else None
