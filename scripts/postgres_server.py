"""A real PostgreSQL for the tests and the service's benchmark: Debian's server binaries (``scripts/setup.sh``
installs the ``postgresql`` package), a cluster made in a temporary directory and started on a free port of
127.0.0.1, stopped at the end. As root, PostgreSQL runs as the ``postgres`` user the package creates (it refuses
to run as root)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Optional


def binaries() -> Optional[Path]:
    """The newest installed PostgreSQL server's bin directory, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


#: starts on a new free port after the one picked was taken meanwhile
START_ATTEMPTS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """A PostgreSQL cluster in a directory of its own (made under the system's tmp, which the ``postgres`` user can
    reach: a test's own tmp directory is private to root), removed by :meth:`stop`."""

    def __init__(self):
        self.bin = binaries()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL server installed: run scripts/setup.sh (apt-get install postgresql)")
        self.directory = Path(tempfile.mkdtemp(prefix="spark_llm-postgres-"))
        self.data, self.sockets = self.directory / "data", self.directory / "sock"
        self.port = _free_port()
        self.user = "postgres" if os.getuid() == 0 else None

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, check=check, timeout=120)

    def start(self) -> "Postgres":
        self.sockets.mkdir(exist_ok=True)
        if self.user:
            shutil.chown(self.directory, self.user)
            shutil.chown(self.sockets, self.user)
            os.chmod(self.directory, 0o755)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        for attempt in range(START_ATTEMPTS):  # PostgreSQL takes no port 0: a free port can be taken before it binds
            try:
                self.resume()
                break
            except subprocess.CalledProcessError:
                log = (self.directory / "postgres.log").read_text(errors="replace")
                if "could not bind" not in log or attempt == START_ATTEMPTS - 1:
                    raise RuntimeError(f"PostgreSQL did not start:\n{log[-3000:]}") from None
                self.port = _free_port()
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "spark_llm")
        return self

    def resume(self) -> None:
        """Start the server (again)."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.directory / "postgres.log"), "-w",
                  "-o", f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1", "start")

    def pause(self) -> None:
        """Stop the server at once (as a crash would), keeping its data."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop", check=False)

    def stop(self) -> None:
        self.pause()
        shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/spark_llm"

    def new_database(self, name: str) -> str:
        """The URL of a new, empty database ``name`` on this server."""
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"
