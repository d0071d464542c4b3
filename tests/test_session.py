"""What a local session learns once and reuses: Delta's resolved jars, the JVM's class-data-sharing archive, the
Python workers' imports (their daemon); and how the local session schedules the run's jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from spark_llm import session


def test_the_first_session_dumps_the_jvm_classes_and_the_next_publishes_and_maps_them(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings = {"spark.jars": "file:///j/delta.jar"}
    first = session._class_data_sharing(settings)
    dump = first[0].split("=", 1)[1]
    assert first[0].startswith("-XX:ArchiveClassesAtExit=") and dump.endswith(f".{os.getpid()}.jsa")
    open(dump, "wb").write(b"archive")
    # a dump whose JVM may still be writing it (its process is alive: this one) is left alone
    assert session._class_data_sharing(settings)[0].startswith("-XX:ArchiveClassesAtExit=")
    finished = dump.replace(f".{os.getpid()}.jsa", ".999999999.jsa")  # its session's process is gone ...
    os.replace(dump, finished)
    # ... but its JVM may still be writing it (it outlives the driver): left alone until it has settled
    assert session._class_data_sharing(settings)[0].startswith("-XX:ArchiveClassesAtExit=")
    settled = time.time() - session.DUMP_SETTLE_SECONDS - 1
    os.utime(finished, (settled, settled))
    mapped = session._class_data_sharing(settings)
    assert mapped[0].startswith("-XX:SharedArchiveFile=") and os.path.exists(mapped[0].split("=", 1)[1])
    assert not os.path.exists(finished)
    open(mapped[0].split("=", 1)[1].replace(".jsa", ".copy.jsa"), "wb").close()  # not a dump of ours: left alone
    assert session._class_data_sharing(settings) == mapped
    # other jars: another archive
    assert session._class_data_sharing({"spark.jars": "file:///j/other.jar"})[0].startswith("-XX:ArchiveClassesAtExit=")


def test_the_class_archive_cache_keeps_the_most_recently_used_archives_and_no_dead_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "spark_llm"
    cache.mkdir()
    for age, key in enumerate(["aaaa", "bbbb", "cccc"]):  # three environments' archives, "aaaa" used last
        (cache / f"jvm-{key}.jsa").write_bytes(b"archive")
        os.utime(cache / f"jvm-{key}.jsa", (1e9 - age * 1000, 1e9 - age * 1000))
        (cache / f"jvm-{key}.999999999.jsa").write_bytes(b"a later dump")  # its JVM gone, the key already archived
    (cache / "jvm-dddd.999999998.jsa").write_bytes(b"dump")  # a finished dump of a fourth, never published
    for dump in cache.glob("jvm-*.99999999?.jsa"):
        os.utime(dump, (1e9 + 500, 1e9 + 500))  # written long ago, after the archives
    (cache / f"jvm-eeee.{os.getpid()}.jsa").write_bytes(b"")  # a live JVM's dump in progress
    mapped = session._class_data_sharing({"spark.jars": "file:///j/delta.jar"})  # a fifth environment: a new dump
    assert mapped[0].startswith("-XX:ArchiveClassesAtExit=")
    left = sorted(p.name for p in cache.iterdir())
    assert left == ["jvm-aaaa.jsa", "jvm-dddd.jsa", f"jvm-eeee.{os.getpid()}.jsa"], left
    assert session.KEPT_CLASS_ARCHIVES == 2
    # mapping an archive makes it the most recently used: the oldest one, mapped now, stays over "aaaa"
    (cache / "jvm-bbbb.jsa").write_bytes(b"archive")
    os.utime(cache / "jvm-bbbb.jsa", (1, 1))
    session._tidy_class_archives(cache, in_use=cache / "jvm-bbbb.jsa")
    assert sorted(p.name for p in cache.iterdir()) == ["jvm-bbbb.jsa", "jvm-dddd.jsa", f"jvm-eeee.{os.getpid()}.jsa"]


def test_the_recorded_delta_jars_are_used_only_while_every_one_is_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    jar = tmp_path / "delta-spark.jar"
    jar.write_bytes(b"")
    assert session.recorded_delta_jars() is None
    session._record_delta_jars(f"file://{jar}")
    assert session.recorded_delta_jars() == f"file://{jar}"
    jar.unlink()
    assert session.recorded_delta_jars() is None
    session._record_delta_jars("file:///some/other.jar")  # a list without Delta's jar is not recorded
    assert session.recorded_delta_jars() is None


def test_a_local_session_s_recorded_jars_are_on_its_jvm_s_class_path_only_while_it_is_launched(tmp_path, monkeypatch):
    """After Spark's own jars (the launcher's SPARK_DIST_CLASSPATH, after anything already there), set only while
    the JVM starts; the class archive is another one for another class path."""
    from pyspark import SparkContext

    dist = session.DIST_CLASSPATH_ENV
    jars = session.jar_paths("file:///j/delta.jar,file:/j/aws.jar,/j/plain.jar")
    assert jars == ["/j/delta.jar", "/j/aws.jar", "/j/plain.jar"]
    monkeypatch.setattr(SparkContext, "_gateway", None)
    monkeypatch.setenv(dist, "/opt/hadoop/lib/*")
    with session._jars_after_spark_s(jars):
        assert os.environ[dist] == os.pathsep.join(["/opt/hadoop/lib/*", *jars])
    assert os.environ[dist] == "/opt/hadoop/lib/*"
    monkeypatch.delenv(dist)
    with session._jars_after_spark_s(jars):
        assert os.environ[dist] == os.pathsep.join(jars)
    assert dist not in os.environ
    monkeypatch.setattr(SparkContext, "_gateway", object())  # this process's JVM runs already: its class path is set
    with session._jars_after_spark_s(jars):
        assert dist not in os.environ

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert session._class_data_sharing({}) != session._class_data_sharing({}, jars)


def test_a_local_session_runs_a_block_s_jobs_in_its_fair_pool_and_restores_the_thread_s_pool(spark):
    sc = spark.sparkContext
    assert sc.getConf().get("spark.scheduler.mode") == "FAIR"
    sc.setLocalProperty("spark.scheduler.pool", "the-callers-pool")
    try:
        with session.scheduler_pool(spark, "spark_llm-test-pool"):
            assert sc.getLocalProperty("spark.scheduler.pool") == "spark_llm-test-pool"
            spark.range(10).count()
        assert sc.getLocalProperty("spark.scheduler.pool") == "the-callers-pool"
    finally:
        sc.setLocalProperty("spark.scheduler.pool", None)
    # the job ran there: the fair scheduler made the pool when the job was submitted to it
    assert sc._jsc.sc().getPoolForName("spark_llm-test-pool").isDefined()
    assert not sc._jsc.sc().getPoolForName("spark_llm-never-used").isDefined()


def test_a_local_session_s_jvm_compiles_with_the_client_compiler_into_the_tiered_code_cache_size(spark):
    """C1 only, and room for its code: with C1 alone the JVM would reserve 48 MiB, which a long session fills, and
    then stops compiling for the rest of its life."""
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    assert bean.getVMOption("TieredStopAtLevel").getValue() == "1"
    assert int(bean.getVMOption("ReservedCodeCacheSize").getValue()) == 240 << 20


def test_a_local_session_s_jvm_runs_the_serial_collector_unless_its_settings_choose_one(spark, tmp_path,
                                                                                       monkeypatch):
    jvm = spark.sparkContext._jvm
    collectors = {b.getName() for b in jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()}
    assert collectors == {"Copy", "MarkSweepCompact"}  # the serial collector's two generations: the test session's
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    options = session.local_java_options({})
    assert options.startswith(f"{session.LOCAL_JAVA_OPTIONS} {session.LOCAL_GC_OPTION}")
    own = session.local_java_options({"spark.driver.extraJavaOptions": "-Xss4m -XX:+UseG1GC"}).split()
    assert session.LOCAL_GC_OPTION not in own and own[-2:] == ["-Xss4m", "-XX:+UseG1GC"]  # two collectors: no JVM
    kept = session.local_java_options({"spark.driver.extraJavaOptions": "-XX:+UseGCOverheadLimit"}).split()
    assert session.LOCAL_GC_OPTION in kept and kept[-1] == "-XX:+UseGCOverheadLimit"


def test_the_worker_daemon_sets_aside_only_the_installed_pyspark_s_own_zips():
    """pyspark.zip and py4j's zip are set aside only when they are the installed package's own (the same code,
    whose bytecode Python caches); another Spark's zips stay on the workers' path."""
    import pyspark

    from spark_llm.worker_daemon import installed_zips

    lib = os.path.join(os.path.dirname(pyspark.__file__), "python", "lib")
    own = [os.path.join(lib, "pyspark.zip"), os.path.join(lib, "py4j-0.10.9.9-src.zip")]
    other = ["/opt/spark/python/lib/pyspark.zip", "/opt/spark/python/lib/py4j-0.10.9.9-src.zip"]
    plain = [p for p in sys.path if not p.endswith(".zip")]
    assert installed_zips([*own, *other, *plain]) == own
    assert installed_zips([*other, *plain]) == []


def test_pyspark_s_worker_module_starts_no_thread_so_the_daemon_may_import_it_before_forking():
    out = subprocess.run([sys.executable, "-c", "import os, pyspark.worker; print(len(os.listdir('/proc/self/task')))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"


def test_a_local_session_s_python_workers_run_pyspark_from_its_package_with_its_worker_preloaded(spark):
    import pandas as pd

    def probe(batches):
        for _ in batches:
            import pyspark
            yield pd.DataFrame({"zips": [sum(p.endswith(".zip") and "pyspark" in p for p in sys.path)],
                                "pyspark": [pyspark.__file__], "daemon": [sys.modules["__main__"].__spec__.name],
                                "frozen": [__import__("gc").get_freeze_count()]})

    row = spark.range(1, numPartitions=1).mapInPandas(
        probe, "zips int, pyspark string, daemon string, frozen long").first()
    assert row["zips"] == 0 and ".zip" not in row["pyspark"] and row["daemon"] == "spark_llm.worker_daemon"
    assert row["frozen"] > 10_000  # what the daemon imported before forking: out of the per-task collections


def test_a_cluster_s_master_on_the_command_line_keeps_the_cluster_s_settings_and_python():
    """`spark-llm run|serve --master spark://...` (or yarn, k8s://): no local defaults (4 shuffle partitions, the
    local JVM's tuning) and not this interpreter for the executors' Python, as under spark-submit; a local master
    gets them."""
    import sys

    from spark_llm.session import DELTA_CONF, LOCAL_DEFAULTS, session_conf

    for master in ("spark://host:7077", "yarn", "k8s://https://api:6443"):
        conf = session_conf(master, {"spark.executor.memory": "40g"})
        assert conf == {**DELTA_CONF, "spark.executor.memory": "40g"}, master
    for master in (None, "local[4]", "local"):
        conf = session_conf(master)
        assert LOCAL_DEFAULTS.items() <= conf.items() and conf["spark.pyspark.python"] == sys.executable
    assert session_conf("local[2]", {"spark.sql.shuffle.partitions": "64"})["spark.sql.shuffle.partitions"] == "64"


def test_packages_resolve_from_maven_central_alone_unless_the_settings_name_repositories(tmp_path, monkeypatch):
    import xml.etree.ElementTree as ET

    def roots(text):
        return [r.get("root") for r in ET.fromstring(text).iter("ibiblio")]
    assert roots(session.ivy_settings()) == ["file:${user.home}/.m2/repository/", session.MAVEN_CENTRAL]
    mirror = "https://mirror.example/maven2/?a=1&b=2"
    assert roots(session.ivy_settings([mirror])) == ["file:${user.home}/.m2/repository/", mirror]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    own = {"spark.jars.ivySettings": "/etc/ivy.xml"}
    assert session.with_own_resolvers(own) == own  # the user's Ivy settings win
    ours = session.with_own_resolvers({"spark.jars.repositories": mirror})
    assert roots(open(ours["spark.jars.ivySettings"]).read())[1:] == [mirror]
    assert os.stat(ours["spark.jars.ivySettings"]).st_mode & 0o077 == 0  # its URLs may carry credentials
    assert ours["spark.jars.ivy"] == os.path.expanduser(session.SPARK_IVY_DIR)  # what Spark downloaded stays found


def test_a_session_resolving_packages_asks_no_repository_it_was_not_given(tmp_path):
    """A JVM of its own resolves a small package from Maven Central into an empty Ivy directory: Ivy's report names
    central alone, and prints no problem (Spark's own chain tries repos.spark-packages.org for every artifact, which
    this machine cannot reach: a problem line each)."""
    script = (
        "from pyspark.sql import SparkSession\n"
        "from spark_llm.session import with_own_resolvers\n"
        f"conf = with_own_resolvers({{'spark.jars.ivy': {str(tmp_path / 'ivy')!r}, "
        "'spark.jars.packages': 'org.slf4j:slf4j-api:2.0.13', 'spark.ui.enabled': 'false'})\n"
        "builder = SparkSession.builder.master('local[1]')\n"
        "for key, value in conf.items():\n"
        "    builder = builder.config(key, value)\n"
        "spark = builder.getOrCreate()\n"
        "print('jars:', spark.sparkContext.getConf().get('spark.jars'))\n"
        "spark.stop()\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = run.stdout + run.stderr
    assert "slf4j-api-2.0.13.jar" in run.stdout
    assert "problems summary" not in printed and "spark-packages" not in printed
    assert "found org.slf4j#slf4j-api;2.0.13 in repo-1" in printed  # Maven Central, as our settings name it


def test_a_local_session_s_console_holds_no_warning_a_user_cannot_act_on(tmp_path):
    """A local session as spark_llm starts one (a JVM of its own, in a process of its own), running a query whose
    plan is wider than Spark prints whole: none of the start-up and plan-text warnings Spark prints by default."""
    script = (
        "from spark_llm.session import get_session\n"
        "spark = get_session('local[1]', {'spark.ui.enabled': 'false'})\n"
        "wide = spark.range(3).selectExpr(*[f'id + {k} AS c{k}' for k in range(40)])\n"
        "print('rows:', wide.where('c39 > 0').count())\n"
        "spark.stop()\n")
    env = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"}
    run = subprocess.run([sys.executable, "-c", script], env={**env, "SPARK_LLM_ENGINE_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "rows: 3" in run.stdout
    quiet = ("Truncated the string representation", "NativeCodeLoader", "resolves to a loopback address",
             "Using Spark's default log4j profile", "Setting default log level", "problems summary")
    assert [line for line in run.stderr.splitlines() if any(q in line for q in quiet)] == []
