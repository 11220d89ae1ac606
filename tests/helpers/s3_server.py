"""A real S3-protocol server on loopback for checkpoint tests: moto's, in a thread.

It listens on 127.0.0.1 only (a free port), so nothing leaves the machine.
Rank processes started by :func:`dist_harness.run_ranks` reach it through the
variables :func:`s3_server` puts in ``os.environ`` (the standard ``AWS_*``
ones, ``AWS_ENDPOINT_URL`` included), as a job on a cluster would.
"""

from __future__ import annotations

import logging
import os
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

BUCKET = "ckpt"

_ERROR = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
    b"<Message>injected by the test</Message></Error>"
)


class Faults:
    """WSGI middleware before moto: answers chosen PUTs with a 500, as a struggling store does.

    :meth:`fail_puts` arms a rule: PUTs whose path holds ``name`` fail ``times``
    times (-1: always). :attr:`failed` lists the paths answered so.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.rules: list[list[Any]] = []
        self.failed: list[str] = []

    def fail_puts(self, name: str, times: int) -> None:
        self.rules.append([name, times])

    def clear(self) -> None:
        self.rules.clear()
        self.failed.clear()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") == "PUT":
            for rule in self.rules:
                if rule[0] in path and rule[1] != 0:
                    rule[1] -= 1
                    # Read the body: a half-read request would break the connection.
                    environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
                    self.failed.append(path)
                    start_response("500 Internal Server Error", [("Content-Type", "text/xml")])
                    return [_ERROR]
        return self.app(environ, start_response)


@dataclass
class S3Server:
    """A running server: the variables that reach it, and its fault injector."""

    env: dict[str, str]
    faults: Faults


def _clear_instances() -> None:
    """Forget cached S3 filesystems: one made for an earlier server points at its port."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def s3_server(bucket: str = BUCKET) -> Iterator[S3Server]:
    """Start the server, create ``bucket``, point ``AWS_*`` at it; yields it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert server._server is not None
    faults = Faults(server._server.app)
    server._server.app = faults  # werkzeug looks the app up per request
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # moto keeps its buckets per process, not per server: start from none.
    reset = urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _clear_instances()
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield S3Server(env, faults)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _clear_instances()
        server.stop()


def fresh_url(scheme: str, tag: str) -> str:
    """A URL no other test writes under: in the test bucket, or ``memory://TAG-...``."""
    name = uuid.uuid4().hex[:10]
    return f"s3://{BUCKET}/{name}" if scheme == "s3" else f"memory://{tag}-{name}"
