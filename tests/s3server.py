"""A real S3-protocol server on 127.0.0.1 for the object-store tests.

moto's standalone server (`moto.server.ThreadedMotoServer`, the same WSGI app as
`python -m moto.server`) speaks the S3 REST protocol over HTTP on a free local port;
TensorStore's `s3` driver talks to it like to any S3-compatible endpoint (path-style
`http://127.0.0.1:<port>/<bucket>/<key>`, SigV4-signed). Nothing is mocked in-process:
every byte goes through TensorStore's HTTP client and the loopback interface.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import tempfile
import time
import urllib.request
from collections.abc import Iterator

# What the fixture sets; the previous values come back when it stops.
ENV_KEYS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_PROFILE",
)
REGION = "us-east-1"


_BUCKETS = itertools.count(1)  # bucket numbers, process-wide


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A running moto S3 server: `.endpoint`, `.client` (boto3), `.new_bucket()`, object
    access by key (`keys`, `get`, `put`, `delete`; as `gcsserver.GcsServer`)."""

    scheme = "s3"

    def __init__(self, endpoint: str, client, server):
        self.endpoint, self.client, self._server = endpoint, client, server

    def new_bucket(self, prefix: str = "ckpt") -> str:
        """Creates a fresh bucket and returns its name: unique in this process, since moto
        keeps its buckets in module-global state that outlives each server (a counter per
        server gave a later module's first bucket the objects of an earlier module's)."""
        name = f"{prefix}-{os.getpid()}-{next(_BUCKETS)}"
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under `prefix` (through boto3, independent of the library)."""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def get(self, bucket: str, key: str) -> bytes:
        """The object's bytes."""
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, body: bytes) -> None:
        """Writes an object."""
        self.client.put_object(Bucket=bucket, Key=key, Body=body)

    def delete(self, bucket: str, key: str) -> None:
        """Removes an object."""
        self.client.delete_object(Bucket=bucket, Key=key)


@contextlib.contextmanager
def running_s3_server() -> Iterator[S3Server]:
    """Starts moto's S3 server on a free port, points the AWS environment at it (dummy
    credentials, region, an empty AWS config so nothing from ~/.aws leaks in), and
    stops it and restores the environment on exit."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="s3cfg-") as cfg:
        empty_config = os.path.join(cfg, "config")
        empty_credentials = os.path.join(cfg, "credentials")
        for p in (empty_config, empty_credentials):
            open(p, "w").close()
        try:
            deadline = time.monotonic() + 30
            while True:  # wait until it answers HTTP
                try:
                    urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"moto S3 server on {endpoint} did not come up") from e
                    time.sleep(0.05)
            for k in ENV_KEYS:
                os.environ.pop(k, None)
            os.environ.update(
                AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                AWS_REGION=REGION, AWS_DEFAULT_REGION=REGION,
                AWS_CONFIG_FILE=empty_config, AWS_SHARED_CREDENTIALS_FILE=empty_credentials,
            )
            import boto3

            client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
            yield S3Server(endpoint, client, server)
        finally:
            server.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
