"""A local S3-compatible server for the object-store tests and benchmarks.

moto's server mode on 127.0.0.1 at a free port: ``start_moto_server`` starts it,
``create_bucket_when_up`` waits (bounded) until it answers and makes a bucket,
``stop_process`` ends it. Needs the ``.[s3]`` extra (moto[server], boto3).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import IO, Any

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on ``HOST`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_moto_server(port: int, log: IO[Any] | int = subprocess.DEVNULL
                      ) -> subprocess.Popen[bytes]:
    """moto's S3 server on ``HOST:port`` (its endpoint is ``http://HOST:port``), stdout and
    stderr into ``log``. It takes a moment to answer: see ``create_bucket_when_up``."""
    return subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)


def create_bucket_when_up(endpoint: str, bucket: str, proc: subprocess.Popen[bytes],
                          timeout_s: float = 30.0) -> None:
    """Create ``bucket`` on the server at ``endpoint``, retrying every 0.2 s until it answers;
    the last error is raised after ``timeout_s`` or once the server process ``proc`` has
    exited. Credentials come from the environment (``AWS_ACCESS_KEY_ID``...)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    deadline = time.monotonic() + timeout_s
    while True:  # bounded wait for the server to answer
        try:
            client.create_bucket(Bucket=bucket)
            return
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """Terminate ``proc`` and reap it; kill it if it has not exited after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
