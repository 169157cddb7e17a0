"""Small MLflow helpers shared by ``mpipemoe train``, ``sweep`` and ``report``.

Everything goes through an explicit ``MlflowClient`` (no fluent ``mlflow.start_run``
state), so these helpers are safe inside Ray Tune trainables that also use
``setup_mlflow`` and inside threads.

    uri = resolve_tracking_uri(None)      # MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db
    run = RunLogger.start(uri, "mpipemoe-train", run_name="tiny-gpt-mpipemoe",
                          parent_run_id=None, tags={"engine": "mpipemoe"})
    run.log_params({"lr": 1e-3, "model": {"d_model": 128}})   # nested dicts flatten to model.d_model
    run.log_metrics({"loss": 2.3}, step=1)                     # buffered, sent in batches
    run.finish()                                               # flushes; status FINISHED

MLflow itself (the ``ray`` extra) is imported inside the functions that talk to a store:
``resolve_tracking_uri`` and ``--tracking-uri none`` runs work without it, and importing
it costs about a second.
"""
from __future__ import annotations

import fcntl
import importlib.util
import math
import os
import sqlite3
import time
import urllib.error
import urllib.request
from pathlib import Path

from app.tracking.node_metrics import start_node_monitors
from app.tracking.offline import MetricSpool, reachable
from app.tracking.records import CHECKOUT, source_commit
from app.tracking.run_kinds import kind_filters
from lm.errors import invocation

PARENT_TAG = "mlflow.parentRunId"
_BATCH = 500  # MLflow accepts at most 1000 metrics / 100 params per log_batch call


NO_TRACKING = "none"


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The store to use: ``uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``.

    Relative sqlite paths and plain directory paths are made absolute against the
    current directory, so Ray workers and Tune trials (whose cwd differs) hit the same store.
    ``"none"`` stays ``"none"``: no MLflow at all (machines without mlflow; see NullRun).
    """
    if uri == NO_TRACKING:
        return uri
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str((Path.cwd() / uri[len("sqlite:///"):]).resolve())
    if "://" not in uri and not uri.startswith("file:"):  # file:PATH is a URI: check_store_form names its fix
        return str(Path(uri).resolve())
    return uri


def check_store_form(tracking_uri: str) -> None:
    """Local, no I/O but a stat. Raise ValueError naming ``sqlite:///PATH`` for a plain path or
    ``file://`` (MLflow's file store: MLflow 3 refuses to write it unless told to, in a
    deprecation text cut mid-URL on our one-line errors)."""
    if tracking_uri != NO_TRACKING and (tracking_uri.startswith("file:") or "://" not in tracking_uri):
        path = Path(tracking_uri.removeprefix("file://").removeprefix("file:")).expanduser().resolve()
        store = path if path.suffix == ".db" or path.is_file() else path / "mlflow.db"
        raise ValueError(f"--tracking-uri {tracking_uri}: a plain path or file:// is MLflow's file store, which "
                         f"MLflow 3 no longer writes by default: use sqlite:///{store} (a SQLite store; "
                         f"'{NO_TRACKING}': no MLflow)")


STORE_CHECK_TIMEOUT_S = 5  # an MLflow server answers /health in milliseconds; MLflow's own
                           # client retries a dead address for about 4 minutes (7 retries, backoff 2)


def check_store(tracking_uri: str, *, write: bool = True) -> None:
    """Raise ValueError naming the flag and the fix unless the MLflow store at
    ``tracking_uri`` (as resolved by ``resolve_tracking_uri``) is usable; within seconds.

    - ``sqlite:///PATH``: PATH's folder must exist (it is never created: a typo would
      otherwise give an empty store nobody finds); for ``write``, PATH (or, for a new
      store, its folder) must take a write; for reading, an existing PATH must open. The probe
      opens a write transaction and rolls it back, so nothing changes. For ``write``, a new
      store is created here, one process at a time (``_create_sqlite_store``).
    - A plain path or ``file://`` (MLflow's file store): refused, naming ``sqlite:///PATH``.
    - ``http(s)://``: the server must answer ``GET /health``.
    - ``"none"`` and other schemes are not checked.
    """
    if tracking_uri == NO_TRACKING:
        return
    flag = f"--tracking-uri {tracking_uri}"
    check_store_form(tracking_uri)
    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri[len("sqlite:///"):])
        if not path.parent.is_dir():
            raise ValueError(f"{flag}: folder {path.parent} does not exist: create it (mkdir -p {path.parent}) "
                             f"or fix the path")
        if not path.exists() and not os.access(path.parent, os.W_OK):
            raise ValueError(f"{flag}: folder {path.parent} is not writable: choose a writable location")
        if write and not _sqlite_store_ready(path):
            _create_sqlite_store(path, tracking_uri)
        if path.exists():
            try:
                connection = sqlite3.connect(f"file:{path}?mode={'rw' if write else 'ro'}", uri=True, timeout=5)
                try:
                    connection.execute("BEGIN IMMEDIATE" if write else "SELECT count(*) FROM sqlite_master")
                    if write:
                        connection.execute("CREATE TABLE mpipemoe_write_probe (x)")  # rolled back
                        connection.rollback()
                finally:
                    connection.close()
            except sqlite3.Error as error:
                why = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise ValueError(f"{flag}: the store at {path} cannot be {'written' if write else 'read'} "
                                 f"({why}): fix its permissions or free space (or, if it is not an MLflow store, "
                                 f"the path), or use another --tracking-uri ('none': no MLflow)") from None
    elif tracking_uri.startswith(("http://", "https://")):
        url = tracking_uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=STORE_CHECK_TIMEOUT_S):
                pass
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                raise ValueError(f"{flag}: the server refused us (HTTP {error.code}): set MLFLOW_TRACKING_USERNAME "
                                 f"and MLFLOW_TRACKING_PASSWORD (docs/security.md)") from None
            # any other answer: a server is there (older MLflow versions lack /health)
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ValueError(f"{flag}: no MLflow server answers at {tracking_uri} ({reason}): start it "
                             f"(`{invocation()} ui`, or `mlflow server`), fix the address, or use --tracking-uri none") from None


def _sqlite_store_ready(path: Path) -> bool:
    """Whether the SQLite file at ``path`` is an MLflow store whose creation has finished (its
    schema version stamped and the Default experiment present; read-only, no waiting)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=0.1)
        try:
            stamped = connection.execute("SELECT count(*) FROM alembic_version").fetchone()[0]
            default = connection.execute("SELECT count(*) FROM experiments WHERE experiment_id = 0").fetchone()[0]
        finally:
            connection.close()
    except sqlite3.Error:
        return False
    return bool(stamped and default)


def _create_sqlite_store(path: Path, tracking_uri: str) -> None:
    """Create the MLflow store at ``path`` under an exclusive lock on its folder: MLflow's own
    creation is not guarded, and two jobs starting at once on a new store failed, one of them
    with ``table ... already exists`` (issue 28). The second job waits, then finds it ready."""
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not _sqlite_store_ready(path):
            client(tracking_uri).search_experiments(max_results=1)  # creates the tables and Default
    finally:
        os.close(fd)  # releases the lock


def client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


# MLflow 3.17's UI opens in its GenAI view (traces, evaluations); our runs are model training.
# An experiment tagged with this kind opens in the training layout (runs, charts), and the
# UI's workflow switch reads ``workflowType`` from the address (docs/training.md §2).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
TRAINING_VIEW = "#/experiments?workflowType=machine_learning"


def experiment_id(mlflow_client, name: str) -> str:
    """Id of experiment ``name``, created if missing (race-safe), as a model-training experiment."""
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow_client.create_experiment(name, tags=EXPERIMENT_KIND)
    except Exception:  # created concurrently by another process
        found = mlflow_client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def flatten(values: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def git_tags(root: str | Path = CHECKOUT) -> dict[str, str]:
    """The commit the code runs from and whether the checkout has uncommitted changes to
    tracked files, as run tags: ``mlflow.source.git.commit`` (the UI shows it), ``git_commit``
    and ``git_dirty`` ("true"/"false"). From `app.tracking.records.source_commit`: the git checkout at
    ``root`` (an installed copy inside some other repository counts as none), else the commit
    stamped beside a copy; empty when neither says."""
    found = source_commit(root)
    if found is None:
        return {}
    return {"mlflow.source.git.commit": found.commit, "git_commit": found.commit, "git_dirty": str(found.dirty).lower()}


SYSTEM_METRICS_INTERVAL_S = 10  # MLflow's default sampling period


def system_metrics_monitor(tracking_uri: str, run_id: str, resume: bool = False):
    """MLflow's ``SystemMetricsMonitor`` for ``run_id``, started: this machine's CPU, memory,
    disk and network every SYSTEM_METRICS_INTERVAL_S as ``system/...`` metrics, and its GPUs
    where ``pynvml`` (nvidia-ml-py) is importable. None when ``psutil`` is not (the monitor
    needs it: ``pip install psutil``); ``stop()`` it with ``.finish()``."""
    if importlib.util.find_spec("psutil") is None:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, resume_logging=resume,
                                   tracking_uri=tracking_uri)
    monitor.start()
    return monitor


class RunLogger:
    """One MLflow run, written through an explicit client; metrics are buffered. Every run
    started or resumed here carries ``git_tags()``."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.client = client(tracking_uri)
        self._pending = []
        self.spool = None  # a MetricSpool (app/tracking/offline.py) once keep_offline() is called
        self.monitor = None  # a started SystemMetricsMonitor (system_metrics=True), stopped by finish()
        self.node_monitors = None  # the other nodes' monitors (app/tracking/node_metrics.py), stopped by finish()

    def keep_offline(self, path: str | Path, echo=None, retry_every_s: float = 30.0) -> None:
        """If the (HTTP) tracking server stops answering, keep metrics, tags and the final
        status in ``path`` and send them once it is back, instead of failing (app/tracking/offline.py)."""
        self.spool = MetricSpool(path, self.run_id, self.tracking_uri, echo, retry_every_s)

    def _down(self) -> bool:
        """True if records may be kept: a spool is set and the server does not answer (checked
        before sending, so a down server costs a 3 s health check, not MLflow's retries)."""
        return self.spool is not None and not reachable(self.tracking_uri)

    @classmethod
    def start(cls, tracking_uri: str, experiment: str, run_name: str | None = None,
              parent_run_id: str | None = None, tags: dict | None = None,
              system_metrics: bool = False) -> "RunLogger":
        """Create a run in ``experiment`` (nested under ``parent_run_id`` when given);
        ``system_metrics``: log this machine's load to it while it runs (``system_metrics_monitor``)."""
        mlflow_client = client(tracking_uri)
        all_tags = {**git_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        run = mlflow_client.create_run(experiment_id(mlflow_client, experiment),
                                       run_name=run_name, tags=all_tags)
        logger = cls(tracking_uri, run.info.run_id)
        if system_metrics:
            logger.start_monitors()
        return logger

    @classmethod
    def resume(cls, tracking_uri: str, run_id: str, system_metrics: bool = False) -> "RunLogger":
        """Reopen an existing run (status RUNNING again; the git tags of the code now running)."""
        logger = cls(tracking_uri, run_id)
        logger.client.update_run(run_id, status="RUNNING")
        logger.set_tags(git_tags())
        if system_metrics:
            logger.start_monitors(resume=True)
        return logger

    def start_monitors(self, resume: bool = False) -> None:
        """Log system metrics to this run while it runs: this machine's (``system/...``) and, where
        this process drives a Ray cluster, every other node's (``system/node-<IP>/...``)."""
        self.monitor = system_metrics_monitor(self.tracking_uri, self.run_id, resume=resume)
        if self.monitor is not None:
            self.node_monitors = start_node_monitors(self.tracking_uri, self.run_id, resume=resume,
                                                     interval_s=SYSTEM_METRICS_INTERVAL_S)

    def log_params(self, params: dict) -> None:
        """Log (nested) params; values become strings cut to MLflow's 6000-char limit."""
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:5000]) for k, v in flatten(tags).items()]
        if not items:
            return
        if self.spool is not None and (self.spool.waiting or self._down()):
            self.spool.keep(tags={t.key: t.value for t in items})
            return
        try:
            self.client.log_batch(self.run_id, tags=items)
        except Exception as error:
            if not self._down():
                raise
            self.spool.keep(tags={t.key: t.value for t in items}, reason=type(error).__name__)

    def log_metrics(self, metrics: dict, step: int | None = None, flush: bool = False) -> None:
        """Buffer the numeric, finite entries of ``metrics``; others are skipped."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in flatten(metrics).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            self._pending.append(Metric(key, float(value), now, int(step or 0)))
        if flush or len(self._pending) >= _BATCH:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Send the buffered metrics. With ``keep_offline``: while the server is down they go
        to the pending file (tried again every ``retry_every_s``, and when ``final``)."""
        spool = self.spool
        if spool is not None and spool.waiting:
            if not ((final or spool.due()) and reachable(self.tracking_uri)):
                if self._pending:
                    spool.keep(self._pending)
                self._pending = []
                return
            spool.replay(self.client)
        if self._pending and spool is not None and self._down():
            spool.keep(self._pending, reason="no answer to its health check")
            self._pending = []
            return
        while self._pending:
            batch = self._pending[:_BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as error:
                if not self._down():
                    raise
                spool.keep(self._pending, reason=type(error).__name__)
                self._pending = []
                return
            self._pending = self._pending[_BATCH:]

    def finish(self, status: str = "FINISHED") -> None:
        """Flush and close the run with ``status`` (FINISHED, FAILED or KILLED)."""
        if self.node_monitors is not None:
            self.node_monitors.finish()
            self.node_monitors = None
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
        self.flush(final=True)
        if self.spool is not None and self.spool.waiting:
            self.spool.keep(status=status)
            return
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as error:
            if not self._down():
                raise
            self.spool.keep(status=status, reason=type(error).__name__)


def results_store(tracking_uri: str | None, printer, absent: str) -> str | None:
    """Where a command logs the runs of its result file (bench, its step form, simulate): the
    resolved tracking URI, or None when tracking is off or MLflow is not installed (then
    ``absent`` is printed: the results stay in their JSON either way)."""
    if importlib.util.find_spec("mlflow") is None:
        printer(absent)
        return None
    uri = resolve_tracking_uri(tracking_uri)
    return None if uri == NO_TRACKING else uri


def log_result_run(uri: str, experiment: str, run_name: str, tags: dict, params: dict, metrics: dict) -> None:
    """One finished MLflow run holding one row of a result file: its params, and its metrics at
    step 0."""
    run = RunLogger.start(uri, experiment, run_name=run_name, tags=tags)
    run.log_params(params)
    run.log_metrics(metrics, step=0, flush=True)
    run.finish()


def scalar_fields(row: dict) -> tuple[dict, dict]:
    """A result row's params (its str and int fields) and metrics (its numbers, as floats)."""
    params = {k: v for k, v in row.items() if isinstance(v, (str, int)) and not isinstance(v, bool)}
    metrics = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return params, metrics


class NullRun:
    """Stands in for ``RunLogger`` when tracking is off (tracking URI ``"none"``)."""

    run_id = None
    tracking_uri = NO_TRACKING

    def log_params(self, params: dict) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def log_metrics(self, metrics: dict, step: int | None = None, flush: bool = False) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


def find_run(tracking_uri: str, experiment: str, tag: str, value: str) -> str | None:
    """Id of the newest run in ``experiment`` whose tag ``tag`` equals ``value``, or None."""
    mlflow_client = client(tracking_uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = mlflow_client.search_runs([found.experiment_id], filter_string=f"tags.`{tag}` = '{value}'",
                                     order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of metric ``key`` in run ``run_id``, sorted by step."""
    history = client(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def finished_runs(tracking_uri: str, experiments: list[str] | None = None, where: str = ""):
    """Yields ``(experiment name, run)`` for every FINISHED run in ``experiments`` (default:
    all) that also matches the MLflow filter ``where`` (e.g. ``tags.engine = 'mpipemoe'``)."""
    mlflow_client = client(tracking_uri)
    names = {e.experiment_id: e.name for e in mlflow_client.search_experiments()
             if experiments is None or e.name in experiments}
    if not names:
        return
    condition = "attributes.status = 'FINISHED'" + (f" and {where}" if where else "")
    token = None
    while True:
        page = mlflow_client.search_runs(list(names), filter_string=condition, max_results=1000, page_token=token)
        for run in page:
            yield names[run.info.experiment_id], run
        token = page.token
        if not token:
            return


def finished_runs_of_kind(tracking_uri: str, experiments: list[str] | None, kind: str, where: str = ""):
    """``finished_runs`` of the runs tagged ``kind`` (app/tracking/run_kinds.py), under the tag or
    the old one, each run once."""
    seen = set()
    for kind_filter in kind_filters(kind):
        for name, run in finished_runs(tracking_uri, experiments, kind_filter + (f" and {where}" if where else "")):
            if run.info.run_id not in seen:
                seen.add(run.info.run_id)
                yield name, run


def unfinished_runs(tracking_uri: str, experiments: list[str] | None = None) -> dict[str, int]:
    """``{status: count}`` of the runs in ``experiments`` (default: all) that are not
    FINISHED (FAILED, KILLED, or RUNNING: still going, or its driver was killed)."""
    mlflow_client = client(tracking_uri)
    ids = [e.experiment_id for e in mlflow_client.search_experiments()
           if experiments is None or e.name in experiments]
    counts: dict[str, int] = {}
    token = None
    while ids:
        page = mlflow_client.search_runs(ids, filter_string="attributes.status != 'FINISHED'",
                                         max_results=1000, page_token=token)
        for run in page:
            counts[run.info.status] = counts.get(run.info.status, 0) + 1
        token = page.token
        if not token:
            break
    return counts
