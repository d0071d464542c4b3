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


def test_the_streaming_reader_splits_lines_as_hadoop_does():
    from spark_llm.read import split_lines

    data = b"\xef\xbb\xbfa\r\nb\rc\n\n\rd\r\nlast"
    expected = [(b"a", 1, None), (b"b", 2, None), (b"c", 3, None), (b"", 4, None), (b"", 5, None),
                (b"d", 6, None), (b"last", 7, None)]
    for size in (1, 2, 3, 5, 64):  # line ends (a CRLF too) falling across chunk edges
        chunks = [data[i:i + size] for i in range(0, len(data), size)]
        assert list(split_lines(chunks, max_line_bytes=1024, keep=16)) == expected  # the opening BOM dropped
    assert list(split_lines([b"x\n"], 1024, 16)) == [(b"x", 1, None)]  # no empty line after the last line end
    assert list(split_lines([b"x\xef\xbb\xbf\n"], 1024, 16)) == [(b"x\xef\xbb\xbf", 1, None)]  # not at the start: kept


def test_the_streaming_reader_keeps_only_the_first_bytes_of_an_over_long_line():
    from spark_llm.read import split_lines

    long = b'{"custom_id": "huge", "pad": "' + b"a" * 10_000 + b'"}'
    chunks = [b"ok-1\n" + long[:3000], long[3000:7000], long[7000:] + b"\r\nok-2"]
    got = list(split_lines(chunks, max_line_bytes=2048, keep=100))
    assert got == [(b"ok-1", 1, None), (long[:100], 2, len(long)), (b"ok-2", 3, None)]


def test_a_file_that_lost_bytes_to_skipped_lines_is_recognised():
    from spark_llm.read import may_have_skipped

    assert not may_have_skipped(file_size=110, kept_bytes=100, lines=10, max_line_bytes=1024)  # LF endings
    assert not may_have_skipped(file_size=120, kept_bytes=100, lines=10, max_line_bytes=1024)  # CRLF endings
    assert may_have_skipped(file_size=100 + 10 + 2000, kept_bytes=100, lines=10, max_line_bytes=1024)
    # more lines than max_line_bytes: a skipped line could hide in the line-end slack, so the file is read again
    assert may_have_skipped(file_size=3000 + 2048 + 1100, kept_bytes=3000, lines=2048, max_line_bytes=1024)


def test_an_over_long_line_is_one_short_row_and_its_neighbours_keep_their_numbers(spark, tmp_path):
    long = b'{"custom_id": "huge", "pad": "' + b"a" * 100_000 + b'"}'
    (tmp_path / "a.jsonl").write_bytes(b"first\n" + long + b"\r\nthird\n\nfifth")
    (tmp_path / "b.jsonl").write_bytes(b"x\ny\n")  # a file without such a line: read the ordinary way
    rows = {(r["file"].rsplit("/", 1)[-1], r["line_number"]): (bytes(r["value"]), r["line_bytes"])
            for r in read_lines(spark, str(tmp_path), max_line_bytes=4096).collect()}
    assert rows[("a.jsonl", 2)] == (long[:64 * 1024], len(long))
    assert {k: v for k, v in rows.items() if k != ("a.jsonl", 2)} == {
        ("a.jsonl", 1): (b"first", None), ("a.jsonl", 3): (b"third", None), ("a.jsonl", 4): (b"", None),
        ("a.jsonl", 5): (b"fifth", None), ("b.jsonl", 1): (b"x", None), ("b.jsonl", 2): (b"y", None)}


def test_local_files_are_listed_as_spark_lists_them(tmp_path):
    """The dry run's own reader (no Spark) takes what Spark's file source would: a file, a directory's files
    recursively without hidden ones, a glob; Spark keeps what only it reads (remote, Delta, compressed)."""
    from spark_llm.read import local_files, local_lines, local_path

    for name in ("a.jsonl", "sub/b.jsonl", "_SUCCESS", ".hidden", "sub/.crc", "_skip/c.jsonl", "part=1/d.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    uri = f"file:{tmp_path}"
    assert local_files(str(tmp_path)) == [f"{uri}/a.jsonl", f"{uri}/part=1/d.jsonl", f"{uri}/sub/b.jsonl"]
    assert local_files(str(tmp_path / "*.jsonl")) == [f"{uri}/a.jsonl"]
    assert local_files(f"file:{tmp_path}/a.jsonl") == [f"{uri}/a.jsonl"]
    assert local_files(str(tmp_path / "missing.jsonl")) == []
    (tmp_path / "a b%.jsonl").write_text("{}\n")  # quoted in its URI
    quoted = local_files(str(tmp_path / "a b*"))
    assert [local_path(u) for u in quoted] == [str(tmp_path / "a b%.jsonl")]
    assert [list(f["value"]) for f in local_lines(quoted, 1 << 20)] == [[b"{}"]]
    (tmp_path / "z.jsonl.gz").write_bytes(b"")
    (tmp_path / "t" / "_delta_log").mkdir(parents=True)
    assert local_files(str(tmp_path)) is None and local_files(str(tmp_path / "t")) is None
    assert local_files("s3a://bucket/in.jsonl") is None and local_files(str(tmp_path / "{a,b}.jsonl")) is None


def test_local_lines_are_the_lines_spark_reads(spark, tmp_path):
    from spark_llm.read import local_files, local_lines

    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbffirst\r\n\nthird \xff\xfe\rlast-no-newline")
    (tmp_path / "b.jsonl").write_bytes(b"x\ny\n")
    ours = sorted((r.file, r.line_number, bytes(r.value)) for pdf in local_lines(local_files(str(tmp_path)), 1 << 20)
                  for r in pdf.itertuples())
    theirs = sorted((r["file"], r["line_number"], bytes(r["value"])) for r in read_lines(spark, str(tmp_path)).collect())
    assert ours == theirs and len(ours) == 6


def test_an_input_is_prepared_in_the_driver_s_process_while_that_is_sooner_than_spark_s_jobs():
    """prepares_here: Spark's prepare jobs cost a fixed time and share the work among the task threads; this process
    does the work alone. So the more threads, the smaller the input prepared here, and never past the memory bound."""
    from spark_llm.prepare import LOCAL_PREPARE_BYTES, prepares_here

    mb = 1 << 20
    assert prepares_here(12 * mb, 2)          # the 20,000-line overhead benchmark's input
    assert prepares_here(27 * mb, 2) and not prepares_here(28 * mb, 2)    # f r t / (t - 1): 28.5 MB (27.2 MiB)
    assert prepares_here(14 * mb, 32) and not prepares_here(15 * mb, 32)  # 14.7 MB: towards f r (14.25 MB)
    assert prepares_here(LOCAL_PREPARE_BYTES, 1) and not prepares_here(LOCAL_PREPARE_BYTES + 1, 1)
    assert prepares_here(0, 64)


def test_an_input_prepared_in_parts_is_cut_after_its_first_head_lines_lines_wherever_its_chunks_end(monkeypatch):
    """prepare_in_parts: the first part is exactly the first HEAD_LINES rows (a chunk cut where it must, or all of
    them when there are fewer), the rest every later row in order, each row once."""
    import pyarrow as pa

    from spark_llm import prepare

    def chunk(start, n):
        return pa.table({"line_number": pa.array(range(start, start + n), pa.int64()),
                         "error_code": pa.array([None] * n, pa.string())})
    monkeypatch.setattr(prepare, "_handed_to_spark",
                        lambda spark, chunks: [n for c in chunks for n in c["line_number"].to_pylist()])
    for head_lines, sizes in [(4, [4, 4, 2]), (5, [4, 4, 2]), (3, [4, 4, 2]), (20, [4, 4, 2]), (4, [])]:
        monkeypatch.setattr(prepare, "HEAD_LINES", head_lines)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        monkeypatch.setattr(prepare, "_arrow_chunks", lambda models: iter([chunk(s, n) for s, n in zip(starts, sizes)]))
        head, rest = prepare.prepare_in_parts(None, [])
        total = sum(sizes)
        assert head == list(range(min(head_lines, total))), (head_lines, sizes)
        assert rest.wait(None) == list(range(min(head_lines, total), total)), (head_lines, sizes)
