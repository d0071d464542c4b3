"""Spark jobs run from driver threads, so that work which does not depend on each other overlaps: the engines load
while the batch is prepared, waves infer while earlier ones commit, the OpenAI files are written while the report
is computed."""

from __future__ import annotations

from typing import Any, Callable, Optional

from .errors import EngineStartError


class SparkJobInBackground:
    """A driver thread running Spark jobs in the run's job group (pyspark's ``InheritableThread``, which carries
    the job group, or a Connect session's tags, into the thread); :meth:`wait` joins it and returns what ``body``
    returned, or raises what it raised, as :meth:`failure` puts it."""

    def __init__(self, spark: Any, name: str, body: Callable[[], Any]):
        from pyspark import InheritableThread

        self.error: Optional[BaseException] = None
        self.value: Any = None
        self.thread = InheritableThread(target=self._run, args=(body,), name=name, daemon=True, session=spark)
        self.thread.start()

    def _run(self, body: Callable[[], Any]) -> None:
        try:
            self.value = body()
        except BaseException as exc:
            self.error = exc

    def failure(self, exc: BaseException) -> BaseException:
        """The error :meth:`wait` raises for ``exc`` (subclasses make executor-side failures readable)."""
        return exc

    def wait(self) -> Any:
        self.thread.join()
        if self.error is not None:
            raise self.failure(self.error) from None
        return self.value


class EngineJob(SparkJobInBackground):
    """A background Spark job whose tasks use the engines: an executor-side engine start failure is raised as one
    clear error."""

    def failure(self, exc: BaseException) -> BaseException:
        return EngineStartError.from_job(exc)
