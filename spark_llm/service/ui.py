"""The dashboard: ``/ui``, one page that lists a key's batches (status, a progress bar, counts, tokens, time left) and
shows one batch (its errors by code, its ``report.html``, a cancel button). The page itself holds no data: its script
asks the API with the key the user gives it (kept in the browser's session storage), so the dashboard sees exactly
what the key sees through the SDK. Two routes feed it beyond the OpenAI API, behind the same keys: a batch's errors
by code and its report."""

from __future__ import annotations

import collections
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from .access import own_batch, owner, service_of
from .lifecycle import CANCELLABLE, Status
from .protocol import APIError

router = APIRouter()


@router.get("/ui/api/batches/{batch_id}/errors")
def errors_by_code(request: Request, batch_id: str, who: str = Depends(owner)) -> dict:
    """The batch's error lines counted by code (read from its error file as it streams: never all at once)."""
    service = service_of(request)
    batch = own_batch(request, batch_id, who)
    counts: collections.Counter = collections.Counter()
    record = service.store.file(batch.error_file_id) if batch.error_file_id else None
    if record is not None:
        tail = b""
        for chunk in service.files.chunks(record.location):
            *lines, tail = (tail + chunk).split(b"\n")
            for line in lines:
                counts[_code(line)] += 1
        if tail.strip():
            counts[_code(tail)] += 1
    return {"batch": batch_id, "final": record is not None, "errors_by_code": dict(counts.most_common())}


def _code(line: bytes) -> str:
    try:
        return json.loads(line)["error"]["code"] or "unknown"
    except (ValueError, KeyError, TypeError):
        return "unknown"


@router.get("/ui/api/batches/{batch_id}/report")
def report(request: Request, batch_id: str, who: str = Depends(owner)) -> Response:
    """The batch's ``report.html`` (its run writes it beside the output files)."""
    service = service_of(request)
    own_batch(request, batch_id, who)
    location = service.files.location("batches", batch_id, "report.html")
    if service.files.size(location) is None:
        raise APIError.not_found("report of batch", batch_id)
    return HTMLResponse(b"".join(service.files.chunks(location)))


@router.get("/ui", response_class=HTMLResponse)
def page() -> HTMLResponse:
    return HTMLResponse(PAGE)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>spark_llm batches</title>
<style>
body{font-family:system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;width:100%}th,td{padding:6px 8px;border-bottom:1px solid #ddd;text-align:left}
.bar{width:160px;height:12px;background:#eee;border-radius:6px;overflow:hidden;display:inline-block}
.bar div{height:100%;background:#4c72b0}.failed div{background:#c44e52}
.status{font-weight:600}.muted{color:#777}button{cursor:pointer}
iframe{width:100%;height:900px;border:1px solid #ddd}#key-form{margin-bottom:16px}
</style></head><body>
<h1>spark_llm batches</h1>
<form id="key-form"><label>API key <input id="key" type="password" autocomplete="off"></label>
<button type="submit">Use key</button> <span id="who" class="muted"></span></form>
<div id="error" role="alert" style="color:#c44e52"></div>
<div id="list"><table><thead><tr><th>batch</th><th>status</th><th>progress</th><th>completed</th><th>failed</th>
<th>tokens in / out</th><th>time left</th><th>created</th></tr></thead><tbody id="rows"></tbody></table></div>
<div id="detail" hidden><p><a href="#" id="back">all batches</a></p><h2 id="title"></h2>
<p id="summary"></p><button id="cancel">Cancel batch</button><h3>Errors by code</h3>
<table><thead><tr><th>code</th><th>lines</th></tr></thead><tbody id="codes"></tbody></table>
<h3>Report</h3><iframe id="report" title="report" sandbox></iframe></div>
<script>
const CANCELLABLE = __CANCELLABLE__, IN_PROGRESS = "__IN_PROGRESS__";  // service/lifecycle.py's
const key = () => sessionStorage.getItem("spark_llm_key") || "";
const api = async (path, opts = {}) => {
  const r = await fetch(path, {...opts, headers: {"Authorization": "Bearer " + key(), ...(opts.headers || {})}});
  if (!r.ok) { const e = await r.json().catch(() => ({})); throw new Error((e.error && e.error.message) || r.status); }
  return r;
};
const when = t => t ? new Date(t * 1000).toLocaleString() : "";
// every value from the API goes into markup through esc: shown as text, never run as HTML
const esc = v => String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
                                                           "'": "&#39;"})[c]);
function left(b) {
  const n = b.request_counts, done = n.completed + n.failed;
  if (b.status !== IN_PROGRESS || !b.in_progress_at || !done || !n.total) return "";
  const rate = done / (Date.now() / 1000 - b.in_progress_at);
  return Math.max(0, Math.round((n.total - done) / rate)) + " s";
}
function bar(b) {
  const n = b.request_counts, pct = n.total ? Math.round(100 * (n.completed + n.failed) / n.total) : 0;
  return `<span class="bar ${b.status === "failed" ? "failed" : ""}" role="progressbar" aria-valuenow="${esc(pct)}"` +
         ` aria-valuemin="0" aria-valuemax="100"><div style="width:${esc(pct)}%"></div></span> ${esc(pct)}%`;
}
async function list() {
  const page = await (await api("/v1/batches?limit=100")).json();
  document.getElementById("rows").innerHTML = page.data.map(b => {
    const u = b.usage || {input_tokens: 0, output_tokens: 0};
    return `<tr data-batch="${esc(b.id)}"><td><a href="#${esc(encodeURIComponent(b.id))}">${esc(b.id)}</a></td>` +
      `<td class="status">${esc(b.status)}</td><td>${bar(b)}</td><td>${esc(b.request_counts.completed)}</td>` +
      `<td>${esc(b.request_counts.failed)}</td><td>${esc(u.input_tokens)} / ${esc(u.output_tokens)}</td>` +
      `<td>${esc(left(b))}</td><td>${esc(when(b.created_at))}</td></tr>`;
  }).join("");
}
async function detail(id) {
  const b = await (await api("/v1/batches/" + encodeURIComponent(id))).json();
  document.getElementById("title").textContent = b.id;
  const n = b.request_counts;
  document.getElementById("summary").innerHTML = `<span class="status" id="detail-status">${esc(b.status)}</span> ` +
    `${bar(b)} ${esc(n.completed)} completed, ${esc(n.failed)} failed of ${esc(n.total)}. ` +
    esc(left(b) ? "About " + left(b) + " left." : "");
  document.getElementById("cancel").hidden = !CANCELLABLE.includes(b.status);
  const codes = await (await api(`/ui/api/batches/${encodeURIComponent(id)}/errors`)).json();
  document.getElementById("codes").innerHTML = Object.entries(codes.errors_by_code)
    .map(([c, k]) => `<tr><td>${esc(c)}</td><td>${esc(k)}</td></tr>`).join("") ||
    `<tr><td colspan="2" class="muted">${codes.final ? "none" : "when the batch is done"}</td></tr>`;
  const frame = document.getElementById("report");
  if (!frame.dataset.batch || frame.dataset.batch !== id) {
    try {
      frame.srcdoc = await (await api(`/ui/api/batches/${encodeURIComponent(id)}/report`)).text();
      frame.dataset.batch = id;
    }
    catch (e) { frame.srcdoc = "<p>The report is written when the batch is done.</p>"; }
  }
}
// the batch the page shows: the hash, as list() wrote it (encoded)
const shown = () => { try { return decodeURIComponent(location.hash.slice(1)); } catch { return ""; } };
async function refresh() {
  const id = shown();
  document.getElementById("list").hidden = !!id;
  document.getElementById("detail").hidden = !id;
  try { if (id) { await detail(id); } else { await list(); } document.getElementById("error").textContent = ""; }
  catch (e) { document.getElementById("error").textContent = e.message; }
}
document.getElementById("key-form").onsubmit = e => {
  e.preventDefault(); sessionStorage.setItem("spark_llm_key", document.getElementById("key").value);
  document.getElementById("who").textContent = "key set"; refresh();
};
document.getElementById("back").onclick = e => { e.preventDefault(); location.hash = ""; };
document.getElementById("cancel").onclick = async () => {
  await api("/v1/batches/" + encodeURIComponent(shown()) + "/cancel", {method: "POST"}); refresh();
};
window.onhashchange = refresh;
refresh(); setInterval(refresh, 2000);
</script></body></html>
""".replace("__CANCELLABLE__", json.dumps(sorted(s.value for s in CANCELLABLE))).replace(
    "__IN_PROGRESS__", Status.IN_PROGRESS.value)
