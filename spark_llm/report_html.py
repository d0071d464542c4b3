"""A self-contained ``report.html`` for one run: summary table and plots, drawn as inline SVG.

Inputs are small: the batch object, the partition plan, one metrics record per partition and a prompt-length
histogram computed by Spark. No rows reach the driver. The plots are a few dozen SVG elements each, written as text:
no plotting library is imported (matplotlib's import and four PNGs cost a 2,000-line run's driver 0.7 CPU-seconds,
on the engines' cores), nothing global changes in the caller's process, and the page stays small, sharp at any zoom
and readable without a network.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional, Sequence

from .batch import BatchObject, RunPlan
from .metrics import engine_usage
from .schemas import PartitionRecord

PLOTS = ("prompt-length histogram", "estimated tokens per partition", "throughput per partition",
         "timeline of partitions")

#: Plot size in SVG user units (the page scales it to its width) and the margins around the axes.
WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 28, 44
#: Most x-axis labels under a bar chart (every k-th bar is labelled beyond that).
MAX_X_LABELS = 12
LANE_HEIGHT = 22


def ticks(top: float, n: int = 4) -> list[float]:
    """Round axis ticks from 0 to at least ``top``, about ``n`` steps of 1, 2, 2.5 or 5 times a power of ten."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / n
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def _num(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.3g}"


def _text(x: float, y: float, text: str, anchor: str = "middle", size: int = 11, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
            f"{html.escape(text)}</text>")


@dataclass(frozen=True)
class Caption:
    """What a plot says in words: its name (for screen readers), title and axis labels."""

    name: str
    title: str
    xlabel: str
    ylabel: str = ""


def _frame(caption: Caption, height: int, left: int, body: list[str]) -> str:
    """An SVG of the plot ``body`` (already placed), with its caption."""
    middle = (TOP + height - BOTTOM) / 2
    ylabel = caption.ylabel
    return (f'<svg role="img" aria-label="{html.escape(caption.name)}" viewBox="0 0 {WIDTH} {height}" '
            f'width="{WIDTH}" height="{height}" font-family="sans-serif" xmlns="http://www.w3.org/2000/svg">'
            + _text(WIDTH / 2, 16, caption.title, size=13, font_weight="bold")
            + _text((left + WIDTH - RIGHT) / 2, height - 6, caption.xlabel)
            + (_text(14, middle, ylabel, transform=f"rotate(-90 14 {middle:.1f})") if ylabel else "")
            + "".join(body) + "</svg>")


def bar_chart(caption: Caption, labels: Sequence[str], values: Sequence[float], color: str,
              mean: Optional[float] = None, adjacent: bool = False) -> str:
    """Bars of ``values`` over ``labels`` (a histogram's bars touch: ``adjacent``), a y axis from 0 with round
    ticks, and a dashed line at ``mean`` when given."""
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
    scale = ticks(max([*values, mean or 0, 0]))
    top = scale[-1]
    y = lambda v: y0 - (y0 - y1) * v / top  # noqa: E731
    body = []
    for t in scale:
        body.append(f'<line x1="{x0 - 4}" y1="{y(t):.1f}" x2="{x1}" y2="{y(t):.1f}" stroke="#e4e4e4"/>')
        body.append(_text(x0 - 6, y(t) + 4, _num(t), anchor="end", size=10))
    body += [f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="#444"/>',
             f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#444"/>']
    slot = (x1 - x0) / max(len(values), 1)
    width = slot if adjacent else slot * 0.8
    every = max(1, math.ceil(len(values) / MAX_X_LABELS))
    for i, (label, v) in enumerate(zip(labels, values)):
        left = x0 + i * slot + (slot - width) / 2
        body.append(f'<rect x="{left:.1f}" y="{y(v):.1f}" width="{max(width - (0.5 if adjacent else 0), 0.5):.1f}" '
                    f'height="{y0 - y(v):.1f}" fill="{color}"><title>{html.escape(f"{label}: {_num(v)}")}</title>'
                    f"</rect>")
        if i % every == 0:
            body.append(_text(x0 + i * slot + (0 if adjacent else slot / 2), y0 + 14, label, size=10))
    if mean is not None and values:
        body.append(f'<line x1="{x0}" y1="{y(mean):.1f}" x2="{x1}" y2="{y(mean):.1f}" stroke="#000" '
                    f'stroke-dasharray="5,4"/>')
        body.append(_text(x1 - 2, y(mean) - 4, f"mean {_num(round(mean, 1))}", anchor="end", size=10))
    return _frame(caption, HEIGHT, LEFT, body)


def timeline(caption: Caption, lanes: list[tuple[str, list[tuple[PartitionRecord, float, float]]]]) -> str:
    """A lane per label (see :func:`engine_lanes`) with each span as a bar from its start to its end, in seconds
    since the earliest start, labelled with its partition."""
    left = 8 + 6 * max([len(label) for label, _ in lanes] + [4])
    height = TOP + LANE_HEIGHT * max(len(lanes), 1) + BOTTOM
    x0, x1, y0 = left, WIDTH - RIGHT, height - BOTTOM
    spans = [s for _, lane in lanes for s in lane]
    t0 = min((start for _, start, _ in spans), default=0.0)
    scale = ticks(max((end - t0 for _, _, end in spans), default=0.0))
    x = lambda t: x0 + (x1 - x0) * (t - t0) / scale[-1]  # noqa: E731
    body = []
    for t in scale:
        body.append(f'<line x1="{x(t0 + t):.1f}" y1="{TOP}" x2="{x(t0 + t):.1f}" y2="{y0 + 4}" stroke="#e4e4e4"/>')
        body.append(_text(x(t0 + t), y0 + 16, _num(t), size=10))
    body.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="#444"/>')
    for n, (label, lane) in enumerate(lanes):
        top = TOP + n * LANE_HEIGHT
        body.append(_text(x0 - 6, top + LANE_HEIGHT / 2 + 4, label, anchor="end", size=10))
        for m, start, end in lane:
            tip = html.escape(f"partition {m.partition}: {end - start:.1f} s")
            body.append(f'<rect x="{x(start):.1f}" y="{top + 2}" width="{max(x(end) - x(start), 0.5):.1f}" '
                        f'height="{LANE_HEIGHT - 4}" fill="#8172b2" stroke="#fff"><title>{tip}</title></rect>')
            inside = x(end) - x(start) >= 8 + 6 * len(str(m.partition))  # else after the bar, in the lane
            body.append(_text(x(start) + 3 if inside else x(end) + 2, top + LANE_HEIGHT / 2 + 4,
                              f"p{m.partition}", anchor="start", size=9, fill="#fff" if inside else "#333"))
    return _frame(caption, height, x0, body)


def plots(histogram: list[tuple[int, int]], plan: RunPlan, metrics: Sequence[PartitionRecord]) -> dict[str, str]:
    """The report's plots as SVG, by name (:data:`PLOTS`)."""
    tokens = plan.tokens_per_partition or []
    by_partition = sorted(metrics, key=lambda m: m.partition)
    return {
        PLOTS[0]: bar_chart(Caption(PLOTS[0], "Prompt length", "prompt tokens (bucket start)", "requests"),
                            [_num(b) for b, _ in histogram], [n for _, n in histogram], "#4c72b0", adjacent=True),
        PLOTS[1]: bar_chart(Caption(PLOTS[1], f"Balance (max/mean {plan.balance_ratio or 1.0})", "partition",
                                    "estimated tokens"),
                            [str(i) for i in range(len(tokens))], tokens, "#55a868",
                            mean=sum(tokens) / len(tokens) if tokens else None),
        PLOTS[2]: bar_chart(Caption(PLOTS[2], "Engine throughput per partition", "partition", "tokens / s"),
                            [str(m.partition) for m in by_partition],
                            [m.tokens_per_second or 0 for m in by_partition], "#c44e52"),
        PLOTS[3]: timeline(Caption(PLOTS[3], "Timeline of partitions per engine (each feeding task in a lane)",
                                   "seconds since the first partition started"), engine_lanes(metrics)),
    }


def engine_lanes(metrics: Sequence[PartitionRecord]
                 ) -> list[tuple[str, list[tuple[PartitionRecord, float, float]]]]:
    """The partitions of each engine as lanes of the timeline: a partition's span in its engine (from its first
    request in to its last answer out; its task's start and end for records without them), in the first lane of
    its engine that is free by then, so the partitions that fed an engine at once sit in lanes one under another."""
    lanes: list[tuple[str, list]] = []
    by_engine: dict[tuple, list[tuple[PartitionRecord, float, float]]] = {}
    for m in metrics:
        start, end = m.engine_started_at or m.started_at or 0.0, m.engine_finished_at or m.finished_at or 0.0
        by_engine.setdefault((str(m.engine_slot), m.engine_pid), []).append((m, start, end))
    for (slot, pid), spans in sorted(by_engine.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        mine: list[list] = []
        for span in sorted(spans, key=lambda s: s[1]):
            lane = next((ln for ln in mine if ln[-1][2] <= span[1]), None)
            if lane is None:
                mine.append([span])
            else:
                lane.append(span)
        lanes.extend((f"{slot} pid {pid}" + (f" #{n + 1}" if len(mine) > 1 else ""), lane)
                     for n, lane in enumerate(mine))
    return lanes


MODEL_COLUMNS = ("model", "partitions", "requests", "prompt tokens", "completion tokens", "engine seconds",
                 "tokens/s per engine", "engine loads")


def _model_rows(metrics: Sequence[PartitionRecord]) -> list[tuple]:
    """One row per model of the batch (in the order they ran), from the partitions' metrics records."""
    groups: dict[str, list[PartitionRecord]] = {}
    for m in sorted(metrics, key=lambda m: m.started_at or 0.0):
        groups.setdefault(m.model or "-", []).append(m)
    rows = []
    for model, recs in groups.items():
        prompt = sum(int(r.prompt_tokens or 0) for r in recs)
        completion = sum(int(r.completion_tokens or 0) for r in recs)
        engine_s = engine_usage(recs).engine_seconds  # each engine's spans united: two tasks feed it at once
        rows.append((model, len(recs), sum(int(r.rows) for r in recs), prompt, completion, round(engine_s, 1),
                     round((prompt + completion) / engine_s) if engine_s else "-",
                     sum(1 for r in recs if (r.engine_load_seconds or 0) > 0)))
    return rows


def render(batch: BatchObject, metrics: Sequence[PartitionRecord], histogram: list[tuple[int, int]],
           errors_by_code: dict[str, int], wall_seconds: float, simulated: Optional[str] = None) -> str:
    """The report as one HTML string, from the batch object, one metrics record per partition, the prompt-length
    histogram and the error counts; ``simulated``: the engine stand-in that gave the answers."""
    plan = batch.partition_plan or RunPlan()
    counts, usage = batch.request_counts, batch.usage
    inference_wall = plan.inference_wall_seconds
    busy = plan.busy_fraction
    rows = [
        ("batch", batch.id), ("status", batch.status), ("model", batch.model),
        ("requests", counts.total), ("completed", counts.completed), ("failed", counts.failed),
        ("input tokens", usage.input_tokens), ("output tokens", usage.output_tokens),
        ("runs of this batch", plan.runs or 1),
        ("wall time of this run", f"{wall_seconds:.1f} s"),
        ("inference wall time (all runs)", f"{inference_wall:.1f} s" if inference_wall else "-"),
        ("throughput (inference wall)",
         f"{usage.total_tokens / inference_wall:.1f} tokens/s" if inference_wall else "-"),
        ("engine busy time (each engine's partition spans, united)", f"{plan.engine_seconds or 0.0:.1f} s"),
        ("engine busy fraction (busy time / (engines x inference wall))", f"{busy:.1%}" if busy is not None else "-"),
        ("prefix-cache hit rate (cached / prompt tokens)",
         f"{plan.prefix_cache_hit_rate:.1%}" if plan.prefix_cache_hit_rate is not None else "-"),
        ("partitions that waited for an engine load", sum(1 for m in metrics if (m.engine_load_seconds or 0) > 0)),
        ("partitions inferred (all runs)", len(metrics)),
        ("partitions planned (this run)", plan.num_partitions or 0),
        ("balance max/mean (this run)", plan.balance_ratio if plan.balance_ratio is not None else "-"),
    ]
    summary = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    errors = "".join(f"<tr><td>{html.escape(c)}</td><td>{n}</td></tr>"
                     for c, n in sorted(errors_by_code.items(), key=lambda kv: -kv[1])) or \
        "<tr><td colspan=2>no errors</td></tr>"
    by_model = _model_rows(metrics)
    models = "" if len(by_model) < 2 else (
        "<h2>Models</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in MODEL_COLUMNS) + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in by_model)
        + "</table>")
    figures = "".join(f"<h2>{html.escape(name.capitalize())}</h2><figure>{svg}</figure>"
                      for name, svg in plots(histogram, plan, metrics).items())
    created = datetime.fromtimestamp(batch.created_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>spark_llm report {html.escape(batch.id)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin-bottom:1em}}th,td{{border:1px solid #ccc;padding:4px 10px;text-align:left}}
th{{background:#f4f4f4}}figure{{margin:0}}svg{{max-width:100%;height:auto}}</style></head><body>
<h1>Batch {html.escape(batch.id)}</h1><p>Started {created}.</p>{_simulated_banner(simulated)}
<h2>Summary</h2><table>{summary}</table>
{models}<h2>Errors by code</h2><table><tr><th>code</th><th>count</th></tr>{errors}</table>
{figures}
<script type="application/json" id="batch">{html.escape(json.dumps(batch.model_dump(mode="json")))}</script>
</body></html>
"""


def _simulated_banner(simulated: Optional[str]) -> str:
    """What a report of a batch that the engine stand-in answered says first."""
    if not simulated:
        return ""
    return (f'<p id="simulated" style="background:#fff3cd;padding:8px"><strong>Simulated:</strong> the engine '
            f'stand-in {html.escape(simulated)} answered every request (engine_standin); the answers are '
            f'not a model\'s, the timings are the job\'s own at the stand-in\'s rates.</p>')
