# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The tests of checkpoints on object storage run against a real S3 API server on 127.0.0.1, which
the ``s3_endpoint`` fixture starts once per session; a test module that uses it names this module in
its ``pytest_plugins``."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest


@contextlib.contextmanager
def s3_server():
    """Run moto's S3 API server on a free port of 127.0.0.1 while in this context; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)],
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the S3 API server did not start")
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait()


@pytest.fixture(scope="session")
def s3_endpoint():
    """The URL of a real S3 API server on 127.0.0.1 (moto's server mode) that runs while the session's
    tests run."""
    pytest.importorskip("s3fs", reason="checkpoints on object storage need s3fs")
    pytest.importorskip("moto.server", reason="the S3 API server of the tests is moto's: pip install 'moto[server]'")
    with s3_server() as endpoint:
        yield endpoint


@contextlib.contextmanager
def s3_environment(endpoint):
    """The storage client's usual configuration (the environment) for the server at ``endpoint``."""
    environment = {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        yield environment
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def new_bucket():
    """A new bucket on the server of :func:`s3_environment`; returns its name."""
    import s3fs
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return bucket


def upload_folder(folder, url):
    """Upload every file under the local ``folder`` to ``url``, as the storage client does."""
    import s3fs
    fs = s3fs.S3FileSystem()
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            fs.put_file(os.path.join(root, name), f"{url}/{relative}")
