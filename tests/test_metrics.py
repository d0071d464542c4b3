"""Engine usage over a batch's partition records: the busy fraction is engine time over the slots' inference wall,
run by run, so gaps between runs of a resumed batch are not counted as idle engines."""

from __future__ import annotations

import pytest

from dataclasses import asdict, replace

from spark_llm.metrics import engine_usage, latest_records
from spark_llm.schemas import PartitionRecord


def rec(run, partition, start, end, engine_s, slots=2, slot="cpu-1-0", tokens=(10, 5), wave=1):
    return PartitionRecord(run_id=run, task_slots=slots, wave=wave, partition=partition, started_at=start,
                           finished_at=end, engine_seconds=engine_s, engine_slot=slot, prompt_tokens=tokens[0],
                           completion_tokens=tokens[1], rows=1)


def test_busy_fraction_is_engine_time_over_slot_time():
    # two slots, 10 s of inference wall: 20 slot-seconds, of which the engines generated for 15
    records = [rec("a", 0, 100.0, 110.0, 9.0), rec("a", 1, 100.0, 107.0, 6.0, slot="cpu-1-1")]
    usage = engine_usage(records)
    assert usage.busy_fraction == pytest.approx(15 / 20)
    assert usage.inference_wall_seconds == 10.0 and usage.engine_seconds == 15.0 and usage.runs == 1
    assert usage.engine_tokens_per_second == pytest.approx(30 / 15)


def test_runs_are_measured_separately():
    # a crashed run and a resume an hour later: the hour between them is not engine idle time
    records = [rec("a", 0, 0.0, 10.0, 10.0, slots=1), rec("b", 0, 3600.0, 3610.0, 5.0, slots=1)]
    usage = engine_usage(records)
    assert usage.runs == 2 and usage.inference_wall_seconds == 20.0
    assert usage.busy_fraction == pytest.approx(15 / 20)


def test_an_engine_fed_by_two_tasks_at_once_is_busy_for_the_union_of_their_spans():
    # one engine, two feeders: partitions 0 and 1 overlap for 4 s, then a 2 s gap before partition 2
    def fed(partition, start, end):
        return replace(rec("a", partition, start - 0.5, end + 0.5, end - start, slots=2), engines=1,
                       engine_started_at=start, engine_finished_at=end, engine_pid=7)
    records = [fed(0, 100.0, 106.0), fed(1, 102.0, 110.0), fed(2, 112.0, 114.0)]
    usage = engine_usage(records)
    assert usage.engine_seconds == pytest.approx(12.0)  # 100-110 and 112-114, not 6 + 8 + 2
    assert usage.inference_wall_seconds == pytest.approx(15.0)  # 99.5 .. 114.5
    assert usage.busy_fraction == pytest.approx(12 / 15)
    assert usage.engine_tokens_per_second == pytest.approx(45 / 12, abs=0.05)  # rounded to 0.1


def test_a_retried_partition_counts_once():
    first, retry = rec("a", 0, 0.0, 5.0, 4.0), rec("a", 0, 6.0, 9.0, 2.0)
    assert latest_records([retry, first]) == [retry]
    assert engine_usage([]).busy_fraction is None


def test_the_report_tallies_both_tables_at_once_and_lists_the_errors_without_a_custom_id(spark):
    from spark_llm.report import Tables

    outputs = spark.createDataFrame(
        [(3, 2, "/v1/chat/completions"), (40, 5, "/v1/chat/completions"), (7, 0, "/v1/embeddings")],
        "prompt_tokens int, completion_tokens int, endpoint string")
    errors = spark.createDataFrame(
        [("invalid_json", None, "line is not JSON", "in.jsonl", 9), ("invalid_json", None, "not JSON", "in.jsonl", 4),
         ("context_length_exceeded", "r-7", "prompt too long", "in.jsonl", 7)],
        "code string, custom_id string, message string, file string, line_number long")
    error_rows = []
    tables = Tables.read(outputs, errors, buckets=4, then=error_rows.append)
    assert (tables.tally.completed, tables.tally.failed) == (3, 3)
    assert (tables.tally.input_tokens, tables.tally.output_tokens) == (50, 7)
    assert tables.endpoint == "/v1/chat/completions,/v1/embeddings"
    assert tables.errors_by_code == {"invalid_json": 2, "context_length_exceeded": 1}
    assert tables.unattributed.total == 2 and [e.line for e in tables.unattributed.data] == [4, 9]
    assert tables.histogram == [(0, 2), (40, 1)]  # width 10 over 40 tokens: 3 and 7 in the first bucket
    assert error_rows == [3]  # errors.jsonl is written knowing the errors table's rows


def test_the_timeline_puts_the_partitions_that_fed_an_engine_at_once_in_lanes_one_under_another():
    from spark_llm.report_html import engine_lanes

    def fed(partition, slot, start, end):
        return PartitionRecord(wave=1, partition=partition, rows=1, engine_slot=slot, engine_pid=7,
                               started_at=start - 1, finished_at=end + 1, engine_started_at=start,
                               engine_finished_at=end)
    lanes = engine_lanes([fed(0, "cpu-1-0", 0, 10), fed(1, "cpu-1-0", 2, 12), fed(2, "cpu-1-0", 10, 15),
                          fed(3, "cpu-1-1", 0, 9)])
    assert [(label, [m.partition for m, _, _ in spans]) for label, spans in lanes] == [
        ("cpu-1-0 pid 7 #1", [0, 2]), ("cpu-1-0 pid 7 #2", [1]), ("cpu-1-1 pid 7", [3])]


def test_partition_records_land_in_the_metrics_table_as_they_were_recorded(spark, tmp_path):
    """append_records: epoch seconds become UTC timestamps, missing fields nulls, the table is made on first use
    and a second append adds to it."""
    from spark_llm.schemas import METRICS_COLUMNS
    from spark_llm.storage import append_records, read_table

    path = str(tmp_path / "metrics")
    first = PartitionRecord(batch_id="b", run_id="r1", wave=1, partition=0, rows=7, engine_slot="cpu-1-0",
                            engine_seconds=1.5, started_at=1_700_000_000.25, errors_by_code='{"engine_error": 1}')
    append_records(spark, [asdict(first)], path, METRICS_COLUMNS)
    append_records(spark, [{**asdict(first), "run_id": "r2", "partition": 1, "rows": 3}], path, METRICS_COLUMNS)
    rows = sorted(read_table(spark, path).collect(), key=lambda r: r["partition"])
    assert [(r["run_id"], r["partition"], r["rows"]) for r in rows] == [("r1", 0, 7), ("r2", 1, 3)]
    assert rows[0]["started_at"].timestamp() == 1_700_000_000.25
    assert rows[0]["engine_seconds"] == 1.5 and rows[0]["finished_at"] is None and rows[0]["engine_pid"] is None
    # read back as it was recorded (the report of a resumed batch reads the table so)
    assert PartitionRecord.from_row(rows[0]) == first and PartitionRecord.from_row(rows[0]).errors() == {
        "engine_error": 1}


def test_the_report_draws_its_plots_as_inline_svg_with_round_ticks_and_escaped_labels():
    import xml.etree.ElementTree as ET

    from spark_llm.batch import RunPlan
    from spark_llm.report_html import PLOTS, Caption, engine_lanes, plots, ticks, timeline

    assert ticks(40) == [0, 10, 20, 30, 40] and ticks(7) == [0, 2, 4, 6, 8] and ticks(0) == [0.0, 1.0]
    assert ticks(1234) == [0, 500, 1000, 1500]
    metrics = [PartitionRecord(wave=1, partition=p, rows=1, engine_slot="cpu-1-<0>", engine_pid=7,
                               started_at=100.0 + p, finished_at=105.0 + p, tokens_per_second=10.0 * (p + 1))
               for p in range(3)]
    svgs = plots([(0, 5), (10, 2), (20, 1)], RunPlan(tokens_per_partition=[10, 20, 30], balance_ratio=1.5), metrics)
    assert list(svgs) == list(PLOTS)
    ns = "{http://www.w3.org/2000/svg}"
    for name, svg in svgs.items():
        root = ET.fromstring(svg)  # well-formed XML, slot names with < > escaped
        assert root.get("aria-label") == name
    bars = [r for r in ET.fromstring(svgs[PLOTS[1]]).iter(f"{ns}rect")]
    assert [float(b.get("height")) for b in bars] == sorted(float(b.get("height")) for b in bars)  # 10 < 20 < 30
    assert len(bars) == 3 and "mean 20" in svgs[PLOTS[1]]
    assert "cpu-1-&lt;0&gt; pid 7" in svgs[PLOTS[3]] and svgs[PLOTS[3]].count("<rect") == 3
    shuffled = plots([], RunPlan(), [metrics[2], metrics[0], metrics[1]])[PLOTS[2]]  # records in the order they started
    assert [t.text for t in ET.fromstring(shuffled).iter(f"{ns}title")] == ["0: 10", "1: 20", "2: 30"]
    assert "<rect" not in timeline(Caption("empty", "t", "s"), engine_lanes([]))  # no partitions: axes only
