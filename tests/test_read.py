"""Raw line reading: every line kept with its file and exact 1-based line number, bytes untouched."""

from __future__ import annotations

import pytest

from spark_llm.config import ConfigError
from spark_llm.read import read_lines


def rows_by_file(df):
    out = {}
    for r in df.collect():  # test-sized data
        out.setdefault(r["file"].rsplit("/", 1)[-1], {})[r["line_number"]] = bytes(r["value"])
    return out


def test_line_numbers_blank_lines_bom_crlf_and_bad_bytes(spark, tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbffirst\r\n\nthird \xff\xfe\nlast-no-newline")
    (tmp_path / "b.jsonl").write_bytes(b"x\ny\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    got = rows_by_file(read_lines(spark, str(tmp_path)))
    assert got["a.jsonl"] == {1: b"first", 2: b"", 3: b"third \xff\xfe", 4: b"last-no-newline"}
    assert got["b.jsonl"] == {1: b"x", 2: b"y"}
    assert "empty.jsonl" not in got


def test_line_numbers_stay_exact_when_a_file_is_split_across_tasks(spark, tmp_path):
    lines = [f"line-{i:05d}-" + "x" * (i % 37) for i in range(1, 5001)]
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "small.jsonl").write_text("s1\ns2\n")
    old = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "8192")  # ~30 splits for the big file
    try:
        df = read_lines(spark, str(tmp_path / "*.jsonl"))
        assert df.rdd.getNumPartitions() > 10
        got = rows_by_file(df)
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", old)
    assert len(got["big.jsonl"]) == 5000
    assert all(got["big.jsonl"][n] == lines[n - 1].encode() for n in range(1, 5001))
    assert got["small.jsonl"] == {1: b"s1", 2: b"s2"}


def test_missing_input_is_a_config_error(spark, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_lines(spark, str(tmp_path / "nope*.jsonl"))
