"""The Python worker daemon of the local sessions spark_llm starts (``spark.python.daemon.module``): pyspark's own
daemon, with two start-up costs paid once per executor instead of once per Python worker.

- pyspark comes from its installed package, whose compiled bytecode Python caches, instead of the ``pyspark.zip``
  (and py4j zip) Spark puts first on its workers' path, whose sources Python compiles again in every process that
  imports them (``import pyspark.worker``: 1.3 s of CPU from the zip, 0.3 s installed), and whose indexes every
  task's ``importlib.invalidate_caches()`` reads again.
  Only the zips of the installed package itself are set aside (pip's pyspark, whose package directory is
  ``SPARK_HOME``): the same code, byte for byte. Any other Spark's zips stay where Spark put them.
- ``pyspark.worker`` is imported before the daemon forks its workers, so each worker starts with it. It starts no
  thread (checked in the tests); pandas and pyarrow, which do, are imported by each worker after the fork, as
  pyspark's daemon does. Its objects are then frozen (``gc.freeze``, as Python's docs advise before forking):
  pyspark collects garbage after every task of a reused worker, and need not walk them each time.

Spark runs it as ``python -m spark_llm.worker_daemon pyspark.worker``; everything else is pyspark's daemon.
"""

from __future__ import annotations

import gc
import os
import sys
from importlib.machinery import PathFinder
from typing import Sequence


def installed_zips(path: Sequence[str]) -> list[str]:
    """The entries of ``path`` that are the installed pyspark's own ``python/lib`` zips (pyspark's and py4j's), when
    pyspark (and py4j) can be imported from ``path`` without them."""
    plain = [p for p in path if not p.endswith(".zip")]
    spec = PathFinder.find_spec("pyspark", plain)
    if spec is None or not spec.submodule_search_locations:
        return []
    lib = os.path.join(list(spec.submodule_search_locations)[0], "python", "lib")
    has_py4j = PathFinder.find_spec("py4j", plain) is not None
    return [p for p in path if os.path.dirname(p) == lib and (
        os.path.basename(p) == "pyspark.zip" or (has_py4j and os.path.basename(p).startswith("py4j-")))]


def main() -> None:
    zips = set(installed_zips(sys.path))
    sys.path[:] = [p for p in sys.path if p not in zips]
    import pyspark.worker  # noqa: F401  (thread-free: imported once here, inherited by every forked worker)
    from pyspark import daemon

    gc.freeze()  # what the workers inherit stays out of the collections pyspark runs after each of their tasks
    daemon.manager()


if __name__ == "__main__":
    main()
