"""A self-contained ``report.html`` for one run: summary table and plots (matplotlib, embedded as PNG).

Inputs are small: the batch object, the partition plan, one metrics record per partition and a prompt-length
histogram computed by Spark. No rows reach the driver.
"""

from __future__ import annotations

import base64
import html
import io
import json
import threading
from datetime import datetime, timezone
from typing import Any

from .metrics import engine_usage

PLOTS = ("prompt-length histogram", "estimated tokens per partition", "throughput per partition",
         "timeline of partitions")


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def preload() -> None:
    """Import the plotting modules (a second of the driver's CPU). Nothing is drawn and no backend is selected."""
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401


def preload_in_background() -> None:
    """:func:`preload` from a daemon thread: started when inference starts, while the driver waits for the engines,
    rather than in the report after it, where the import held the GIL while the report's queries ran (a no-op when
    the modules are imported already)."""
    threading.Thread(target=preload, name="spark_llm-plots", daemon=True).start()


def _figure() -> tuple[Any, Any]:
    """A figure of our own (``matplotlib.figure.Figure``): no pyplot state and no backend switch in the user's
    process."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3))
    return fig, fig.subplots()


def _plots(histogram: list[tuple[int, int]], plan: dict, metrics: list[dict]) -> dict[str, str]:
    from matplotlib.ticker import MaxNLocator

    out = {}
    fig, ax = _figure()
    if histogram:
        edges, counts = zip(*histogram)
        width = (edges[1] - edges[0]) if len(edges) > 1 else 1
        ax.bar(edges, counts, width=width, align="edge", color="#4c72b0")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("requests")
    ax.set_title("Prompt length")
    out[PLOTS[0]] = _png(fig)

    fig, ax = _figure()
    tokens = plan.get("tokens_per_partition") or []
    ax.bar(range(len(tokens)), tokens, color="#55a868")
    if tokens:
        ax.axhline(sum(tokens) / len(tokens), color="black", linestyle="--", linewidth=1, label="mean")
        ax.legend()
    ax.set_xlabel("partition")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("estimated tokens")
    ax.set_title(f"Balance (max/mean {plan.get('balance_ratio', 1.0)})")
    out[PLOTS[1]] = _png(fig)

    fig, ax = _figure()
    ax.bar([m["partition"] for m in metrics], [m["tokens_per_second"] for m in metrics], color="#c44e52")
    ax.set_xlabel("partition")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tokens / s")
    ax.set_title("Engine throughput per partition")
    out[PLOTS[2]] = _png(fig)

    fig, ax = _figure()
    if metrics:
        t0 = min(m["started_at"] for m in metrics)
        lanes = engine_lanes(metrics)
        for y, (_, spans) in enumerate(lanes):
            for m, start, end in spans:
                ax.barh(y, end - start, left=start - t0, color="#8172b2", edgecolor="white")
                ax.text(start - t0, y, f" p{m['partition']}", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(lanes)), [label for label, _ in lanes])
    ax.set_xlabel("seconds since the first partition started")
    ax.set_title("Timeline of partitions per engine (each feeding task in a lane)")
    out[PLOTS[3]] = _png(fig)
    return out


def engine_lanes(metrics: list[dict]) -> list[tuple[str, list[tuple[dict, float, float]]]]:
    """The partitions of each engine as lanes of the timeline: a partition's span in its engine (from its first
    request in to its last answer out; its task's start and end for records without them), in the first lane of
    its engine that is free by then, so the partitions that fed an engine at once sit in lanes one under another."""
    lanes: list[tuple[str, list]] = []
    by_engine: dict[tuple, list[tuple[dict, float, float]]] = {}
    for m in metrics:
        start, end = m.get("engine_started_at") or m["started_at"], m.get("engine_finished_at") or m["finished_at"]
        by_engine.setdefault((str(m.get("engine_slot")), m.get("engine_pid")), []).append((m, start, end))
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


def _model_rows(metrics: list[dict]) -> list[tuple]:
    """One row per model of the batch (in the order they ran), from the partitions' metrics records."""
    groups: dict[str, list[dict]] = {}
    for m in sorted(metrics, key=lambda m: m["started_at"]):
        groups.setdefault(m.get("model") or "-", []).append(m)
    rows = []
    for model, recs in groups.items():
        prompt = sum(int(r["prompt_tokens"] or 0) for r in recs)
        completion = sum(int(r["completion_tokens"] or 0) for r in recs)
        engine_s = engine_usage(recs)["engine_seconds"]  # each engine's spans united: two tasks feed it at once
        rows.append((model, len(recs), sum(int(r["rows"]) for r in recs), prompt, completion, round(engine_s, 1),
                     round((prompt + completion) / engine_s) if engine_s else "-",
                     sum(1 for r in recs if r["engine_load_seconds"] > 0)))
    return rows


def render(batch: dict, metrics: list[dict], histogram: list[tuple[int, int]], errors_by_code: dict[str, int],
           wall_seconds: float) -> str:
    """The report as one HTML string, from the batch object (as a dict), one metrics record per partition, the
    prompt-length histogram and the error counts."""
    plan = batch.get("partition_plan") or {}
    counts, usage = batch["request_counts"], batch["usage"]
    inference_wall = plan.get("inference_wall_seconds")
    busy = plan.get("busy_fraction")
    rows = [
        ("batch", batch["id"]), ("status", batch["status"]), ("model", batch.get("model")),
        ("requests", counts["total"]), ("completed", counts["completed"]), ("failed", counts["failed"]),
        ("input tokens", usage["input_tokens"]), ("output tokens", usage["output_tokens"]),
        ("runs of this batch", plan.get("runs", 1)),
        ("wall time of this run", f"{wall_seconds:.1f} s"),
        ("inference wall time (all runs)", f"{inference_wall:.1f} s" if inference_wall else "-"),
        ("throughput (inference wall)",
         f"{usage['total_tokens'] / inference_wall:.1f} tokens/s" if inference_wall else "-"),
        ("engine busy time (each engine's partition spans, united)", f"{plan.get('engine_seconds', 0.0):.1f} s"),
        ("engine busy fraction (busy time / (engines x inference wall))", f"{busy:.1%}" if busy is not None else "-"),
        ("prefix-cache hit rate (cached / prompt tokens)",
         f"{plan['prefix_cache_hit_rate']:.1%}" if plan.get("prefix_cache_hit_rate") is not None else "-"),
        ("partitions that waited for an engine load", sum(1 for m in metrics if m["engine_load_seconds"] > 0)),
        ("partitions inferred (all runs)", len(metrics)),
        ("partitions planned (this run)", plan.get("num_partitions", 0)),
        ("balance max/mean (this run)", plan.get("balance_ratio", "-")),
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
    plots = "".join(f'<h2>{html.escape(name.capitalize())}</h2><img alt="{html.escape(name)}" '
                    f'src="data:image/png;base64,{data}">' for name, data in _plots(histogram, plan, metrics).items())
    created = datetime.fromtimestamp(batch["created_at"], timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>spark_llm report {html.escape(batch['id'])}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin-bottom:1em}}th,td{{border:1px solid #ccc;padding:4px 10px;text-align:left}}
th{{background:#f4f4f4}}img{{max-width:100%}}</style></head><body>
<h1>Batch {html.escape(batch['id'])}</h1><p>Started {created}.</p>
<h2>Summary</h2><table>{summary}</table>
{models}<h2>Errors by code</h2><table><tr><th>code</th><th>count</th></tr>{errors}</table>
{plots}
<script type="application/json" id="batch">{html.escape(json.dumps(batch))}</script>
</body></html>
"""
