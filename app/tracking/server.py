"""The MLflow tracking server of ``mpipemoe ui`` and of a cluster's head node: its command line
and the checks of its stores, before it starts.

A cluster's store outlives the cluster: runs in PostgreSQL (e.g. Amazon RDS), artifacts in S3
(or any S3-compatible store), served by several server processes (a database takes several
writers; a SQLite file does not). Clients upload artifacts through the server, so only the
server needs the object store's credentials.

    mlflow_server_command("postgresql://mlflow:PW@db:5432/mlflow", 5000, "10.0.1.5",
                          artifacts_destination="s3://bucket/mlflow", workers=4)
"""
from __future__ import annotations

import importlib.util
import sys
from urllib.parse import urlsplit, urlunsplit

# Each store scheme and the Python module MLflow needs to talk to it. SQLAlchemy 2.1 reads a
# plain postgresql:// as psycopg (version 3); postgresql+psycopg2:// names the older driver.
STORE_DRIVERS = {"postgresql": "psycopg", "s3": "boto3"}
INSTALL_HINT = "pip install 'mpipemoe[tracking-server]'"


def mlflow_server_command(backend_store_uri: str, port: int, host: str, *,
                          artifacts_destination: str | None = None, workers: int = 1) -> list[str]:
    """The ``mlflow server`` command line: ``backend_store_uri`` for runs, params and metrics,
    ``artifacts_destination`` (when given) for artifacts, served through the server."""
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
               "--host", host, "--port", str(port), "--workers", str(workers)]
    if artifacts_destination:
        command += ["--artifacts-destination", artifacts_destination]
    return command


def redact_password(uri: str) -> str:
    """``uri`` with the password of its user part replaced by ``***`` (for printing)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def _scheme(uri: str) -> str:
    """``postgresql`` for ``postgresql+psycopg2://...``: the database part of the scheme."""
    return uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else ""


def _driver(uri: str) -> str | None:
    """The module the store at ``uri`` needs: the one its scheme names after '+', else the default."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if "+" in scheme:
        return scheme.split("+", 1)[1]
    return STORE_DRIVERS.get(scheme)


def check_server_stores(backend_store_uri: str, artifacts_destination: str | None, workers: int) -> None:
    """Local, no I/O. Raise ValueError naming the flag, the value and the fix when the server
    could not serve these stores: a driver package missing for the scheme, an S3 destination
    without a bucket, or several workers on a SQLite store (one writer)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers {workers}: give a whole number of server processes, 1 or more")
    scheme = _scheme(backend_store_uri)
    if scheme == "sqlite" and workers > 1:
        raise ValueError(f"--workers {workers} with --tracking-uri {backend_store_uri}: a SQLite store has one "
                         f"writer; use --workers 1, or a database store (postgresql://...) for more")
    if scheme == "postgres":
        raise ValueError(f"--tracking-uri {redact_password(backend_store_uri)}: SQLAlchemy names the scheme "
                         f"postgresql://, not postgres://: write postgresql://...")
    for flag, uri in (("--tracking-uri", backend_store_uri), ("--artifacts-destination", artifacts_destination)):
        if not uri:
            continue
        driver = _driver(uri)
        if driver and importlib.util.find_spec(driver) is None:
            raise ValueError(f"{flag} {redact_password(uri)}: the MLflow server needs the Python module "
                             f"{driver} for it: {INSTALL_HINT}")
    if artifacts_destination and _scheme(artifacts_destination) == "s3" and not urlsplit(artifacts_destination).netloc:
        raise ValueError(f"--artifacts-destination {artifacts_destination}: name the bucket, "
                         f"s3://BUCKET/PREFIX (e.g. s3://my-bucket/mlflow)")
