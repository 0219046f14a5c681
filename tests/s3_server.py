"""A real S3-compatible server (moto) on the loopback interface, for tests of remote checkpoints.

``start()`` runs it in this process on a free port and returns its endpoint; ``client_env(endpoint)`` gives the
variables a process needs to reach it through s3fs (fsspec reads ``FSSPEC_S3_ENDPOINT_URL``), so subprocesses
(real ranks) use the same server.
"""

from __future__ import annotations

import os
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def client_env(endpoint: str) -> dict[str, str]:
    return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": endpoint}


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in CREDENTIALS.items() if k != "AWS_DEFAULT_REGION"},
                 region_name=CREDENTIALS["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)  # fmt: skip


def configure_this_process(endpoint: str) -> None:
    """Point fsspec's s3 in this process at the server (fsspec read its environment at import already)."""
    os.environ.update(client_env(endpoint))
    import fsspec.config

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass
