"""A Spark session with Delta Lake and the settings the pipeline relies on."""

from __future__ import annotations

import contextlib
import hashlib
import html
import logging
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

from pyspark.sql import SparkSession

from .engine_host.directory import LOCAL_EXECUTOR_ENV
from .engine_host.spec import apply_worker_env
from .engine_host.isolation import RECOMMENDED_TASK_ATTEMPTS
from .host import private_file, process_alive
from .session_info import is_connect, is_local_master, spark_conf

log = logging.getLogger(__name__)

#: Settings for a local session (demo, tests, single machine). Cluster jobs keep their own spark-submit settings.
#: A local session's rows are few (requests, results, a wave's metrics) beside the engines' work, so its queries
#: run interpreted: compiling each query's generated Java (Janino, then the JIT) costs more of a short run's CPU,
#: on the engines' cores, than running the rows does (about 6 CPU-seconds of a 15- or 2,000-line run). Nor do they
#: need adaptive execution, which plans each query again after every shuffle, on cold code, to coalesce or
#: rebalance partitions that a local session's few rows and few shuffle partitions never call for: without it a
#: 15-line run takes 0.93-0.96 of the time. ``spark:`` settings of the config override these.
LOCAL_DEFAULTS = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    "spark.sql.adaptive.enabled": "false",
    "spark.scheduler.mode": "FAIR",  # the engines hold every task slot: scheduler_pool
    "spark.scheduler.allocation.file": str(Path(__file__).with_name("fairscheduler.xml")),
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.python.worker.reuse": "true",
    # A cancelled task's Python worker is ended this long after Spark notices the cancel (within 2 s; Spark's
    # default waits 2 s more): an inference task waits on its engine and never ends by itself, and its slot is
    # wanted at once (context.cancel_waves).
    "spark.python.task.killTimeout": "100ms",
    "spark.python.daemon.module": "spark_llm.worker_daemon",  # pyspark's daemon, its imports made once
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.sources.partitionOverwriteMode": "dynamic",
    "spark.driver.memory": "2g",
}
#: The fair-scheduler pools of a local session (configured in fairscheduler.xml, see scheduler_pool): the one served
#: first when an engine's task ends (commits, a wave's shuffle), and the inference tasks', in wave order.
FIRST_POOL = "spark_llm-commit"
WAVES_POOL = "spark_llm-waves"
#: The pool of a high-priority batch's inference tasks (the batch service runs several batches on one session): served
#: before the waves' pool when a task slot frees.
URGENT_POOL = "spark_llm-urgent"
#: JVM options of a local session's driver (which is also its executor): the client compiler only. A short run
#: otherwise spends more CPU time in the JIT's optimising compiler than in Spark's own work, on the same cores as
#: the engines; the work a local JVM does (reading, shuffles, Delta commits) is small beside the engines'. Options
#: given in spark.driver.extraJavaOptions come after these, so ``-XX:TieredStopAtLevel=4`` there restores C2. The
#: client compiler alone would reserve 48 MiB for compiled code, which a session running two 5,000-request batches
#: fills ("CodeCache is full. Compiler has been disabled": interpreted for the rest of the session's life), so the
#: tiered size, 240 MiB, is asked for (reserved address space, committed as used).
LOCAL_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
#: The collector of a local session's JVM unless spark.driver.extraJavaOptions choose one (two would stop it from
#: starting): the serial one. Its heap is small (spark.driver.memory) and its cores are the engines'; G1's
#: concurrent threads cost a 15-line run 1-2.5 CPU-seconds more on two cores.
LOCAL_GC_OPTION = "-XX:+UseSerialGC"
#: Environment of a local session's Python workers besides the engine's own (engine.WORKER_ENV_DEFAULTS): this
#: interpreter, and a 1 GiB KV cache when vLLM runs on the CPU (the CPU build reads this variable, GPU builds do
#: not).
LOCAL_ENV = {"PYSPARK_PYTHON": sys.executable, "VLLM_CPU_KVCACHE_SPACE": "1"}
#: Attempts of a task in a local session (``local[N,F]``): enough for a poison request to be isolated and set
#: aside, as ``spark.task.maxFailures`` on a cluster.
LOCAL_TASK_ATTEMPTS = RECOMMENDED_TASK_ATTEMPTS
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def get_session(master: Optional[str] = None, conf: Optional[Mapping[str, str]] = None,
                app_name: str = "spark_llm", remote: Optional[str] = None) -> SparkSession:
    """The active session if there is one (Databricks, notebooks); under spark-submit the session its command line
    describes (plus Delta's SQL extension); else a new one that pulls Delta's jars from Maven Central through
    ``spark.jars.packages`` (the first time; then the jars it resolved): on a cluster's ``master`` with the
    cluster's own settings (:func:`session_conf`), or a local one (``master`` default ``local[2]``) that runs its
    Python workers on this interpreter, with the engine's worker environment (set in this process's environment
    where not already set, since local workers inherit it).

    With ``remote``, a Spark Connect session instead: ``sc://...`` connects to a running server (Delta and the
    cluster's settings are the server's); ``local[N]`` starts a local Connect server set up like the local session.
    """
    if remote and not remote.startswith("local"):
        return SparkSession.builder.remote(remote).getOrCreate()
    active = SparkSession.getActiveSession()
    if active is not None and not remote:
        return active
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        # launched by spark-submit: master, jars and resources come from its command line / properties file
        builder = SparkSession.builder.appName(app_name)
        for key, value in {**DELTA_CONF, **dict(conf or {})}.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    from delta import configure_spark_with_delta_pip

    named_master = master or dict(conf or {}).get("spark.master")
    local = bool(remote) or is_local_master({"spark.master": named_master or "local[2]"})
    if local:  # the workers are children of this process and inherit its environment, read when Spark starts
        set_local_environment()
    settings = session_conf(None if remote else named_master, conf)
    if remote:  # a local Connect server: its own SparkContext in this process, the client talks gRPC to it
        builder = SparkSession.builder.appName(app_name).remote(with_task_retries(remote))
    else:
        builder = SparkSession.builder.appName(app_name).master(with_task_retries(master or "local[2]"))
    only_delta = not {"spark.jars", "spark.jars.packages"} & set(settings)  # no jars of the caller's own
    s3a = local  # a cluster's Hadoop brings its own S3A connector, of its own version
    recorded = recorded_delta_jars(s3a) if only_delta else None
    class_path = jar_paths(recorded) if recorded and local else []  # see _jars_after_spark_s
    if recorded and not local:
        settings["spark.jars"] = recorded
    if local:
        settings["spark.driver.extraJavaOptions"] = local_java_options(settings, class_path)
    if not recorded:  # Ivy resolves spark.jars.packages
        settings = with_own_resolvers(settings)
    for key, value in settings.items():
        builder = builder.config(key, value)
    with warnings.catch_warnings():  # a Connect client also tries the server's static settings again, in vain
        warnings.simplefilter("ignore", UserWarning)
        packages = [p for p in settings.get("spark.jars.packages", "").split(",") if p]
        packages += [s3a_package()] if s3a and not any(":hadoop-aws:" in p for p in packages) else []
        with _naming_local_executor(remote or settings.get("spark.master") or master or "local[2]") as named, \
                _jars_after_spark_s(class_path), _on_loopback(local):
            spark = (builder if recorded else configure_spark_with_delta_pip(builder, packages)).getOrCreate()
        if named and not remote:
            _NAMED_EXECUTORS[spark.sparkContext.applicationId] = named
    if only_delta and not recorded:
        _record_delta_jars(spark.conf.get("spark.jars", "") or "", s3a)
    if not remote:
        spark.sparkContext.setLogLevel("WARN")
    return spark


def session_conf(master: Optional[str], conf: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The settings a session started from the command line gets, before the caller's ``conf``: a local master
    (``local[N]``, the default) gets :data:`LOCAL_DEFAULTS` (tuned for engines sharing this machine's cores) and
    this interpreter for its Python workers; a cluster's master (``spark://``, ``yarn``, ``k8s://``) only Delta's,
    so the cluster's own settings, memory and Python stay as its administrators set them (as under spark-submit)."""
    if master and not is_local_master({"spark.master": master}):
        return {**DELTA_CONF, **dict(conf or {})}
    return {**LOCAL_DEFAULTS, **DELTA_CONF, "spark.pyspark.python": sys.executable,
            "spark.pyspark.driver.python": sys.executable, **dict(conf or {})}


def set_local_environment() -> None:
    """This process's environment for a local session it is about to start (its JVM and Python workers inherit it):
    the engines' (:func:`~spark_llm.engine_host.apply_worker_env`) and :data:`LOCAL_ENV`, where not set."""
    apply_worker_env()
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)


#: Application id -> executor name (this process's pid) of the local sessions this process started with its engines
#: named by it (:func:`_naming_local_executor`).
_NAMED_EXECUTORS: dict[str, int] = {}


@contextlib.contextmanager
def _naming_local_executor(master: str) -> Iterator[Optional[int]]:
    """While a ``local[N]`` session's JVM is launched from this process: :data:`LOCAL_EXECUTOR_ENV` set to this
    process, for the JVM and its Python workers to inherit, then restored, so that no process this one starts later
    inherits it (yields the name, or None when the session's executor is not named so: another master, or a JVM this
    process launched before, which keeps the environment it started with)."""
    from pyspark import SparkContext

    if not is_local_master({"spark.master": master}) or SparkContext._gateway is not None:
        yield None
        return
    with _set_while_launching(LOCAL_EXECUTOR_ENV, str(os.getpid())):
        yield os.getpid()


#: The launcher's variable for jars on the JVM's class path after Spark's own (``bin/spark-class``).
DIST_CLASSPATH_ENV = "SPARK_DIST_CLASSPATH"


@contextlib.contextmanager
def _jars_after_spark_s(jars: Sequence[str]) -> Iterator[None]:
    """While a local session's JVM is launched from this process: its recorded jars on that JVM's class path after
    Spark's own (:data:`DIST_CLASSPATH_ENV`), then the variable restored. Its executor is that JVM, so they need not
    be ``spark.jars``, which Spark copies into every session's temporary directory on every start (some 740 MB with
    S3A's AWS SDK bundle) and leaves there when the driver is killed. After Spark's own, not before them
    (``spark.driver.extraClassPath``): Spark's versions of what both have win, as in the loader of ``spark.jars``
    (Delta brings an older Jackson than Spark's, which Spark's Scala module refuses)."""
    from pyspark import SparkContext

    if not jars or SparkContext._gateway is not None:
        yield
        return
    previous = os.environ.get(DIST_CLASSPATH_ENV)
    with _set_while_launching(DIST_CLASSPATH_ENV, os.pathsep.join([*([previous] if previous else []), *jars])):
        yield


def _on_loopback(local: bool) -> contextlib.AbstractContextManager[None]:
    """While a local session's JVM is launched: its driver, UI and workers on 127.0.0.1 (``SPARK_LOCAL_IP``), unless
    this process's environment says otherwise. Nothing outside this host talks to them, and Spark would otherwise
    bind every interface and warn, on a host whose name resolves to loopback, that it chose another address."""
    if not local or "SPARK_LOCAL_IP" in os.environ:
        return contextlib.nullcontext()
    return _set_while_launching("SPARK_LOCAL_IP", "127.0.0.1")


@contextlib.contextmanager
def _set_while_launching(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` in this process's environment for the block (a JVM's launch, which inherits it),
    then as it was: no process this one starts later, nor the user's own code, sees it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def local_executor(spark: SparkSession) -> int:
    """The executor of a classic local session as its engines are named: this process, when it started the session
    with its engines named so (:func:`_naming_local_executor`), else the session's JVM."""
    return _NAMED_EXECUTORS.get(spark.sparkContext.applicationId) or jvm_pid(spark)


def _cache() -> Path:
    """This user's cache of what local sessions learn once (Delta's jar list, the JVM's class archive)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spark_llm"


def _delta_jars_record(s3a: bool = False) -> Path:
    import pyspark
    from importlib.metadata import version

    with_s3a = f"-hadoop-aws-{hadoop_version()}" if s3a else ""
    return _cache() / f"delta-spark-{version('delta-spark')}-spark-{pyspark.__version__}{with_s3a}.jars"


def hadoop_version() -> str:
    """The version of the Hadoop client pyspark bundles (its ``hadoop-client-api`` jar)."""
    import pyspark

    jars = sorted(Path(pyspark.__file__).parent.glob("jars/hadoop-client-api-*.jar"))
    if not jars:
        raise RuntimeError(f"no hadoop-client-api jar in pyspark's jars ({Path(pyspark.__file__).parent}/jars)")
    return jars[-1].name[len("hadoop-client-api-"):-len(".jar")]


def s3a_package() -> str:
    """Hadoop's S3A connector (``s3a://``) for the Hadoop pyspark bundles: a local session gets it with Delta's jars
    (with the AWS SDK bundle it depends on), since pyspark ships no object-store connector. The version must be
    Hadoop's own: S3A calls Hadoop's internals, and another version fails on its first request."""
    return f"org.apache.hadoop:hadoop-aws:{hadoop_version()}"


#: The console logging of a local session spark_llm starts (Spark's defaults, less what a user cannot act on).
LOCAL_LOG_CONFIG = Path(__file__).with_name("log4j2.properties")


def local_java_options(settings: Mapping[str, str], class_path: Sequence[str] = ()) -> str:
    """The driver JVM options of a local session spark_llm starts: :data:`LOCAL_JAVA_OPTIONS`, the serial collector
    (:data:`LOCAL_GC_OPTION`) unless the settings' own options choose a collector, :data:`LOCAL_LOG_CONFIG` unless
    they name a logging configuration, the class archive's, then the settings' own (``spark.driver.extraJavaOptions``:
    later options win)."""
    own = settings.get("spark.driver.extraJavaOptions", "")
    gc = [] if re.search(r"-XX:\+Use\w+GC\b", own) else [LOCAL_GC_OPTION]
    logs = [] if "log4j" in own else [f"-Dlog4j2.configurationFile={LOCAL_LOG_CONFIG.as_uri()}"]
    return " ".join([LOCAL_JAVA_OPTIONS, *gc, *logs, *_class_data_sharing(settings, class_path),
                     *([own] if own else [])])


def _class_data_sharing(settings: Mapping[str, str], class_path: Sequence[str] = ()) -> list[str]:
    """JVM options for a class-data-sharing archive of a local session's classes (Spark's, Delta's: some 30,000,
    which a fresh JVM otherwise reads, inflates and verifies from their jars, the largest part of its start). The
    first session dumps the classes it loaded when its JVM exits (``-XX:ArchiveClassesAtExit``, a file named for
    its process); the next one publishes a finished dump and maps it (``-XX:SharedArchiveFile``). The archive is
    keyed by Java, Spark and the jars (``class_path``: those after Spark's own); a JVM that finds it does not match
    its class path ignores it."""
    import pyspark

    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else \
        shutil.which("java") or "java"
    key = hashlib.sha256(repr((os.path.realpath(java), pyspark.__version__, os.path.dirname(pyspark.__file__),
                               settings.get("spark.jars", ""), settings.get("spark.jars.packages", ""),
                               settings.get("spark.driver.extraClassPath", ""), *class_path)).encode()).hexdigest()[:16]
    cache = _cache()
    archive = _class_archive(cache, key)
    quiet = "-Xlog:cds=off -Xlog:cds+dynamic=off"
    with contextlib.suppress(OSError):
        cache.mkdir(parents=True, exist_ok=True)
        _tidy_class_archives(cache, in_use=archive)
        if archive.exists():
            return [f"-XX:SharedArchiveFile={archive}", quiet]
        return [f"-XX:ArchiveClassesAtExit={_class_archive(cache, key, os.getpid())}", quiet]
    return []


#: Seconds a finished session's dump must have been left untouched before it is published: its JVM writes it when
#: it exits, some seconds after the driver process it is named for (about 10 s for 200 MB here).
DUMP_SETTLE_SECONDS = 30
#: Class archives kept in the cache (some 200 MB each), the most recently used: one per Java, Spark and jar set, so
#: a user with a second environment (another virtualenv, another checkout) does not rebuild it on every switch,
#: while the cache does not grow by an archive for every environment ever used.
KEPT_CLASS_ARCHIVES = 2


def _class_archive(cache: Path, key: str, owner: Optional[int] = None) -> Path:
    """``jvm-<key>.jsa``, the published archive of ``key``, or ``jvm-<key>.<owner>.jsa``, the dump of the session
    whose driver process is ``owner``."""
    return cache / (f"jvm-{key}.jsa" if owner is None else f"jvm-{key}.{owner}.jsa")


def _class_archive_name(path: Path) -> tuple[str, str]:
    """(key, owner) of a :func:`_class_archive` path; owner "" for a published archive."""
    key, _, owner = path.name[len("jvm-"):-len(".jsa")].partition(".")
    return key, owner


def _tidy_class_archives(cache: Path, in_use: Path) -> None:
    """Finish what earlier sessions left: each finished dump (its session's process gone, the file untouched for
    :data:`DUMP_SETTLE_SECONDS`) becomes its key's archive, unless that key has one already (two sessions that
    started before either finished), then is deleted; then only the :data:`KEPT_CLASS_ARCHIVES` most recently used
    archives stay, ``in_use`` (this session's) counted as used now. A JVM still mapping a deleted archive keeps its
    pages (the file is gone only from the directory)."""
    for dump in sorted(cache.glob("jvm-*.*.jsa")):  # earlier sessions' dumps, named for their driver's process
        key, owner = _class_archive_name(dump)
        if not owner.isdigit() or process_alive(int(owner)):
            continue  # not a dump of ours, or its session still runs
        with contextlib.suppress(OSError):
            if time.time() - dump.stat().st_mtime < DUMP_SETTLE_SECONDS:
                continue  # its JVM, which outlives the driver by the seconds the dump takes, may still write it
            published = _class_archive(cache, key)
            if not published.exists() and dump.stat().st_size > 0:
                os.replace(dump, published)
            else:
                dump.unlink()
    with contextlib.suppress(OSError):
        os.utime(in_use)
    archives = [a for a in cache.glob("jvm-*.jsa") if not _class_archive_name(a)[1]]
    for stale in sorted(archives, key=lambda a: a.stat().st_mtime, reverse=True)[KEPT_CLASS_ARCHIVES:]:
        with contextlib.suppress(OSError):
            stale.unlink()


def recorded_delta_jars(s3a: bool = False) -> Optional[str]:
    """The Delta jars a local session resolved before (``spark.jars``), while every one is still on disk: Ivy's
    resolution of ``spark.jars.packages`` costs every session start seconds, even with every jar in its cache."""
    try:
        jars = _delta_jars_record(s3a).read_text().strip()
    except OSError:
        return None
    return jars if jars and all(os.path.isfile(path) for path in jar_paths(jars)) else None


def jar_paths(jars: str) -> list[str]:
    """The files of a ``spark.jars`` list (comma-separated paths or ``file:`` URLs)."""
    return ["/" + jar[len("file:"):].lstrip("/") if jar.startswith("file:") else jar for jar in jars.split(",") if jar]


#: Where Maven artifacts come from unless ``spark.jars.repositories`` names others.
MAVEN_CENTRAL = "https://repo1.maven.org/maven2/"
#: Spark's own Ivy directory (its default for ``spark.jars.ivy``), kept when the resolvers are ours.
SPARK_IVY_DIR = "~/.ivy2.5.2"


def ivy_settings(repositories: Sequence[str] = ()) -> str:
    """Ivy's settings for resolving ``spark.jars.packages``: this user's Maven cache, then ``repositories`` (Maven
    Central when none are set), and no other. Spark's own chain also tries repos.spark-packages.org for every
    artifact, and where that host cannot be reached (a firewalled cluster, this project's machines) Ivy prints a
    problem line for each, about 40 on a first start, that says nothing to the user."""
    chain = [("local-m2-cache", "file:${user.home}/.m2/repository/")]
    chain += [(f"repo-{k}", url) for k, url in enumerate(repositories or [MAVEN_CENTRAL], 1)]
    resolvers = "\n".join(f'      <ibiblio name="{name}" m2compatible="true" root="{html.escape(url)}"/>'
                          for name, url in chain)
    return ('<ivysettings>\n  <settings defaultResolver="spark_llm"/>\n  <resolvers>\n'
            f'    <chain name="spark_llm" returnFirst="true">\n{resolvers}\n    </chain>\n'
            '  </resolvers>\n</ivysettings>\n')


def with_own_resolvers(settings: dict[str, str]) -> dict[str, str]:
    """``settings`` that resolve packages from :func:`ivy_settings` (a file in this user's cache), unless they name
    Ivy settings of their own; Spark's Ivy directory kept, so that what it downloaded before is found."""
    if settings.get("spark.jars.ivySettings"):
        return settings
    repositories = [r.strip() for r in settings.get("spark.jars.repositories", "").split(",") if r.strip()]
    text = ivy_settings(repositories)
    path = _cache() / f"ivysettings-{hashlib.sha256(text.encode()).hexdigest()[:12]}.xml"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            private_file(tmp)  # a repository's URL may carry its credentials
            tmp.write_text(text)
            os.replace(tmp, path)
    except OSError:  # no cache to write to: Spark's own resolvers, and their noise
        return settings
    return {**settings, "spark.jars.ivySettings": str(path),
            "spark.jars.ivy": settings.get("spark.jars.ivy") or os.path.expanduser(SPARK_IVY_DIR)}


def _record_delta_jars(jars: str, s3a: bool = False) -> None:
    if "delta-spark" not in jars:
        return
    with contextlib.suppress(OSError):  # only a cache: the next session resolves them again
        record = _delta_jars_record(s3a)
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(jars + "\n")
        os.replace(tmp, record)


def local_worker_env(spark_conf: Mapping[str, str]) -> dict[str, str]:
    """The environment a local session's Python workers get, for a process they would otherwise start (the
    engines, started from the driver): this process's environment (which the session's JVM inherited), the
    session's ``spark.executorEnv.*`` settings, and ``OMP_NUM_THREADS``, which PySpark sets in every Python worker
    to ``spark.task.cpus`` (1 by default) unless ``spark.executorEnv.OMP_NUM_THREADS`` says otherwise."""
    env = dict(os.environ)
    prefix = "spark.executorEnv."
    env.update({k[len(prefix):]: v for k, v in spark_conf.items() if k.startswith(prefix)})
    env["OMP_NUM_THREADS"] = spark_conf.get(prefix + "OMP_NUM_THREADS") or spark_conf.get("spark.task.cpus") or "1"
    return env


def jvm_pid(spark: SparkSession) -> int:
    """The pid of the session's JVM (a classic session's; in a local session, also its only executor's)."""
    return int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def local_session_conf(master: Optional[str], settings: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The settings of the local session :func:`get_session` would start for ``master`` and the config's ``spark:``
    ``settings`` (before it starts; the cluster's own are not known then), which win over the master as there."""
    return {**LOCAL_DEFAULTS, "spark.master": with_task_retries(master or "local[2]"), **dict(settings or {})}


@contextlib.contextmanager
def scheduler_pool(spark: SparkSession, name: str) -> Iterator[None]:
    """The block's Spark jobs (this thread's) in the fair scheduler's pool ``name``, the thread's pool restored
    afterwards. Only in a local session in FAIR mode (:data:`LOCAL_DEFAULTS`), where the engines hold every task
    slot: a slot an engine frees goes first to :data:`FIRST_POOL` (``fairscheduler.xml``), so a commit's short
    tasks and the next wave's shuffle run at once instead of behind the queued inference tasks. Elsewhere nothing:
    a cluster's own pools (a notebook's, say) are left as they are."""
    conf = {} if is_connect(spark) else spark_conf(spark)
    if not is_local_master(conf) or conf.get("spark.scheduler.mode", "FIFO").upper() != "FAIR":
        yield
        return
    sc = spark.sparkContext
    previous = sc.getLocalProperty("spark.scheduler.pool")
    sc.setLocalProperty("spark.scheduler.pool", name)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.scheduler.pool", previous)  # type: ignore[arg-type]


def default_parallelism(spark: SparkSession) -> int:
    """Tasks the cluster runs at once by default (``SparkContext.defaultParallelism``; over Spark Connect, read from
    the settings or from the partitions Spark gives a range without a partition count)."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    configured = spark.conf.get("spark.default.parallelism", None)
    if configured:
        return int(configured)
    from pyspark.sql import functions as F

    return int(spark.range(0, 1 << 16).agg(F.max(F.spark_partition_id())).first()[0]) + 1


def with_task_retries(master: str) -> str:
    """``local`` / ``local[N]`` with :data:`LOCAL_TASK_ATTEMPTS` attempts per task (``local[N,F]``): a local master
    otherwise gives a task one attempt, so one dead worker would fail the batch. Other masters are kept."""
    match = re.fullmatch(r"local(?:\[(\d+|\*)\])?", master.strip())
    return f"local[{match.group(1) or 1},{LOCAL_TASK_ATTEMPTS}]" if match else master


def check_delta(spark: SparkSession) -> None:
    """Fail early, with the fix, when the session cannot write Delta tables (asked of the session itself, so that
    it works over Spark Connect too: a Delta read of a path that does not exist fails for another reason)."""
    from .config import ConfigError

    try:
        spark.read.format("delta").load("/nonexistent/spark_llm-delta-probe").schema
    except Exception as exc:
        if "DATA_SOURCE_NOT_FOUND" not in str(exc) and "Failed to find the data source" not in str(exc):
            return
        raise ConfigError(
            "Delta Lake is not on this Spark session's classpath. spark-submit: add --packages "
            "io.delta:delta-spark_4.2_2.13:<delta version> (see conf/gpu-cluster.yaml) and --conf "
            "spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension; Databricks has it built in") from None
