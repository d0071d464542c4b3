"""A real S3 API for the tests: moto's server (``moto[server]`` from PyPI, installed with the test extra) on a free
port of 127.0.0.1, in a process of its own, stopped at the end. Spark speaks to it through Hadoop's S3A connector,
the tests through boto3: both over HTTP, as against AWS.

    python scripts/s3_server.py            # start one and print its endpoint until Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator, Optional

#: Seconds the server may take to answer its first request (its imports: some 3 s here).
START_SECONDS = 60.0
#: Any key pair works against moto; the tests use these, and search what the job wrote for the secret.
ACCESS_KEY = "AKIASPARKLLMTESTKEY1"
SECRET_KEY = "sparkllm/test+SECRET/do-not-leak-0123456789"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server on 127.0.0.1; :attr:`endpoint` once started."""

    def __init__(self):
        self.process: Optional[subprocess.Popen] = None
        self.endpoint = ""
        # its log (a line per request) goes to a file: a pipe nobody reads fills, and the server stops answering
        self.log = tempfile.NamedTemporaryFile(prefix="s3_server.", suffix=".log", delete=False)

    def start(self) -> "S3Server":
        port = _free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self.process.poll() is not None:
                err = open(self.log.name, encoding="utf-8", errors="replace").read()
                self.stop()
                raise RuntimeError(f"the S3 server (moto) exited with {self.process.returncode}: {err[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the S3 server did not answer on {self.endpoint} in {START_SECONDS:.0f} s")
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server and remove its log."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)

    @contextlib.contextmanager
    def checking_keys(self) -> Iterator[None]:
        """While within: the server checks every request's key, as AWS does, and knows none (moto's IAM holds no
        user), so each is refused as AWS refuses a wrong key (403 InvalidAccessKeyId); by default it takes any."""
        def auth_after(count: str) -> None:
            request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                             headers={"Content-Type": "text/plain"})  # not a form: moto reads the body
            with urllib.request.urlopen(request, timeout=10):
                pass
        auth_after("0")
        try:
            yield
        finally:
            auth_after("inf")

    def client(self):
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def hadoop_settings(self) -> dict[str, str]:
        """Hadoop's S3A settings that reach this server (``fs.s3a.*``; as Spark settings, prefix ``spark.hadoop.``)."""
        return {"fs.s3a.endpoint": self.endpoint, "fs.s3a.endpoint.region": REGION,
                "fs.s3a.path.style.access": "true", "fs.s3a.connection.ssl.enabled": "false",
                "fs.s3a.access.key": ACCESS_KEY, "fs.s3a.secret.key": SECRET_KEY}


def environment(server: S3Server) -> dict[str, str]:
    """The standard environment variables that reach ``server`` (pyarrow and boto3 read them; so does the AWS SDK
    of Hadoop's S3A connector for the keys)."""
    return {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}


if __name__ == "__main__":
    server = S3Server().start()
    print(server.endpoint, flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        server.stop()
