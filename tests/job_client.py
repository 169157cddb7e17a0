"""A Ray job client for the tests of ``ray job submit`` (tests/app/test_cluster_jobs.py),
run as its own process so that the token it
authenticates with is that process's (``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` in its
environment), never the test session's. Prints one JSON line:

    python -m tests.job_client submit ADDRESS ENTRYPOINT ENV_JSON TIMEOUT_S
        {"job_id", "ray_job_id", "status", "logs"}: the job submitted through Ray's job SDK,
        waited for (stopped after TIMEOUT_S); {"refused": ...} where the client cannot connect
    python -m tests.job_client nodes ADDRESS RESOURCE[,RESOURCE...] TIMEOUT_S
        {"alive": n, "missing": [resource]}: once each custom resource is carried by a live
        node (or TIMEOUT_S passed)
    python -m tests.job_client placement ADDRESS RAY_JOB_ID
        {"nodes": {node_id: {"state", "resources"}}, "train_workers": [{"node_id",
        "placement_group_id", "state"}]}: the cluster's nodes and every Ray Train worker
        actor that job started (Ray's state API through the dashboard)
"""
from __future__ import annotations

import json
import sys
import time


def submit(address: str, entrypoint: str, env_vars: dict, timeout_s: float) -> dict:
    from ray.job_submission import JobStatus, JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except Exception as error:  # what a client without the cluster's token sees
        return {"refused": f"{type(error).__name__}: {error}"}
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env_vars})
    deadline = time.monotonic() + timeout_s
    while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            break
        time.sleep(0.2)
    return {"job_id": job_id, "ray_job_id": client.get_job_info(job_id).job_id,
            "status": str(client.get_job_status(job_id)),
            "logs": client.get_job_logs(job_id)[-20000:]}


def placement(address: str, ray_job_id: str) -> dict:
    from ray.util.state import list_actors, list_nodes

    nodes = {n.node_id: {"state": n.state, "resources": n.resources_total}
             for n in list_nodes(address=address, limit=1000)}
    workers = [{"node_id": a.node_id, "placement_group_id": a.placement_group_id, "state": a.state}
               for a in list_actors(address=address, limit=10000, detail=True,
                                    filters=[("class_name", "=", "RayTrainWorker"), ("job_id", "=", ray_job_id)])]
    return {"nodes": nodes, "train_workers": workers}


def wait_nodes(address: str, resources: list[str], timeout_s: float) -> dict:
    from ray.util.state import list_nodes

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            alive = [n for n in list_nodes(address=address, limit=1000, detail=True) if n.state == "ALIVE"]
        except Exception:  # the state API answers a moment after the dashboard does
            alive = []
        missing = [r for r in resources if not any(r in n.resources_total for n in alive)]
        if not missing or time.monotonic() > deadline:
            return {"alive": len(alive), "missing": missing}
        time.sleep(0.5)


if __name__ == "__main__":
    if sys.argv[1] == "submit":
        out = submit(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), float(sys.argv[5]))
    elif sys.argv[1] == "nodes":
        out = wait_nodes(sys.argv[2], sys.argv[3].split(","), float(sys.argv[4]))
    else:
        out = placement(sys.argv[2], sys.argv[3])
    print(json.dumps(out))
