"""A real S3-protocol server on loopback for checkpoint tests: moto's, in a thread.

It listens on 127.0.0.1 only (a free port), so nothing leaves the machine.
Rank processes started by :func:`dist_harness.run_ranks` reach it through the
variables :func:`s3_server` puts in ``os.environ`` (the standard ``AWS_*``
ones, ``AWS_ENDPOINT_URL`` included), as a job on a cluster would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

BUCKET = "ckpt"


def _clear_instances() -> None:
    """Forget cached S3 filesystems: one made for an earlier server points at its port."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def s3_server(bucket: str = BUCKET) -> Iterator[dict[str, str]]:
    """Start the server, create ``bucket``, point ``AWS_*`` at it; yields those variables."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _clear_instances()
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _clear_instances()
        server.stop()
