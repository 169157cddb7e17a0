"""System metrics of every node of a run, not the driver's alone: one small Ray actor per node
runs MLflow's ``SystemMetricsMonitor`` for the run, its metrics named ``system/<node>/...``
(``system/node-10.0.1.7/gpu_3_utilization_percentage``, ``.../gpu_3_memory_usage_megabytes``,
CPU, memory, disk, network) beside the driver's own ``system/...``. GPU metrics need
``nvidia-ml-py`` on the node, all of them ``psutil`` (the ``system-metrics`` extra; the image
of the Dockerfile has both). NVML sees every GPU of the node whatever CUDA_VISIBLE_DEVICES
says, so an actor that holds no GPU reports all eight.

    monitors = start_node_monitors(tracking_uri, run_id)   # None unless Ray is running here
    ...
    monitors.finish()

The actors hold no CPU or GPU (``num_cpus=0``): they take nothing from the training workers.
Nodes that join after the run starts (a replaced node) are not monitored.
"""
from __future__ import annotations

import importlib.util
import sys

NODE_PREFIX = "node-"
STOP_TIMEOUT_S = 30


class NodeMonitor:
    """Local to one node (a Ray actor placed there): MLflow's system-metrics monitor of one run,
    its metrics under ``system/<node_name>/``. Idle where ``psutil`` is missing."""

    def __init__(self, tracking_uri: str, run_id: str, node_name: str, interval_s: float, resume: bool) -> None:
        self.monitor = None
        if importlib.util.find_spec("psutil") is None:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=resume,
                                            node_id=node_name, tracking_uri=tracking_uri)
        self.monitor.start()

    def monitoring(self) -> bool:
        return self.monitor is not None

    def finish(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None


class NodeMonitors:
    """The monitor actors of one run; ``finish()`` stops them (after a last sample each)."""

    def __init__(self, actors: list, names: list[str]) -> None:
        self.actors = actors
        self.names = names

    def finish(self) -> None:
        import ray

        try:
            ray.get([actor.finish.remote() for actor in self.actors], timeout=STOP_TIMEOUT_S)
        except Exception:  # a lost node's actor: its metrics so far are logged; the run goes on
            pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def node_names(nodes: list[dict]) -> dict[str, str]:
    """{Ray node id: metric name} for ``nodes`` (``ray.nodes()`` entries): ``node-<IP>``, with
    the node id's first 8 characters added where several nodes share an IP (one machine)."""
    ips = [node["NodeManagerAddress"] for node in nodes]
    return {node["NodeID"]: NODE_PREFIX + node["NodeManagerAddress"]
            + (f"-{node['NodeID'][:8]}" if ips.count(node["NodeManagerAddress"]) > 1 else "")
            for node in nodes}


def start_node_monitors(tracking_uri: str, run_id: str, *, interval_s: float, resume: bool = False,
                        include_driver_node: bool = False) -> NodeMonitors | None:
    """Start a ``NodeMonitor`` on every live node of the Ray cluster this process is connected to,
    except the driver's own (its monitor is the run's plain ``system/...``) unless
    ``include_driver_node``. None when Ray is not running in this process or no node is left."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n["Alive"] and (include_driver_node or n["NodeID"] != here)]
    if not nodes:
        return None
    names = node_names(nodes)
    monitor_class = ray.remote(num_cpus=0)(NodeMonitor)
    actors = [monitor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
              .remote(tracking_uri, run_id, names[node["NodeID"]], interval_s, resume) for node in nodes]
    return NodeMonitors(actors, [names[node["NodeID"]] for node in nodes])
