"""What a local session learns once and reuses (no Spark started here): Delta's resolved jars and the JVM's
class-data-sharing archive."""

from __future__ import annotations

import os

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
    finished = dump.replace(f".{os.getpid()}.jsa", ".999999999.jsa")  # its process is gone
    os.replace(dump, finished)
    mapped = session._class_data_sharing(settings)
    assert mapped[0].startswith("-XX:SharedArchiveFile=") and os.path.exists(mapped[0].split("=", 1)[1])
    assert not os.path.exists(finished)
    open(mapped[0].split("=", 1)[1].replace(".jsa", ".copy.jsa"), "wb").close()  # not a dump of ours: left alone
    assert session._class_data_sharing(settings) == mapped
    # other jars: another archive
    assert session._class_data_sharing({"spark.jars": "file:///j/other.jar"})[0].startswith("-XX:ArchiveClassesAtExit=")


def test_the_recorded_delta_jars_are_used_only_while_every_one_is_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    jar = tmp_path / "delta-spark.jar"
    jar.write_bytes(b"")
    assert session._recorded_delta_jars() is None
    session._record_delta_jars(f"file://{jar}")
    assert session._recorded_delta_jars() == f"file://{jar}"
    jar.unlink()
    assert session._recorded_delta_jars() is None
    session._record_delta_jars("file:///some/other.jar")  # a list without Delta's jar is not recorded
    assert session._recorded_delta_jars() is None
