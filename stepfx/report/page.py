"""The report's HTML page: one self-contained file drawn from report data.

Everything is inline (style, script, SVG pictures); nothing is fetched.
One ``<section class="rank">`` per rank, each with the same parts: the
passes (a table, then one collapsible ``<details>`` per pass with its graph
diff), the final program (a table with a search box that filters rows),
the timeline (predicted and, after ``step.profile``, measured), memory
(the curve and the holders at the peak) and communication. Every value
from the graph is escaped; element ids are prefixed by the rank.
"""
from __future__ import annotations

from html import escape

from ..explain import format_bytes
from . import plots
from .collect import FORMAT

__all__ = ["render_page"]

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header,section.rank>section{padding:0 24px}
header{background:#20232a;color:#eee;padding:12px 24px}
header h1{margin:0;font-size:20px}
nav a{color:#9cf;margin-right:14px}
h2{border-bottom:1px solid #ccc;padding-top:12px}
h3{margin:6px 0}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border-bottom:1px solid #e3e3e3;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap}
.src{color:#666;font-size:12px}
.phase-forward{color:#2a5b8f}.phase-backward{color:#b35c00}.phase-optimizer{color:#2f7a2f}
tr.add{background:#e9f7ec}tr.del{background:#fbeaea}tr.mod{background:#fff6dd}tr.mov{background:#eef0fb}
details{margin:4px 0;border:1px solid #ddd;border-radius:4px;background:#fff}
details>summary{cursor:pointer;padding:4px 8px}
details[open]>summary{border-bottom:1px solid #ddd}
details .body{padding:4px 10px;overflow-x:auto}
.badge{display:inline-block;border-radius:3px;padding:0 5px;margin-left:4px;font-size:12px}
.b-add{background:#cdeccf}.b-del{background:#f5c6c6}.b-mod{background:#f8e7a8}.b-mov{background:#d6dcf5}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots>figure{margin:0;background:#fff;border:1px solid #ddd}
.plots svg{max-width:100%;height:auto}
.note{color:#555}
input[type=search]{font-size:14px;padding:3px 6px;width:28em}
.scroll{max-height:36em;overflow:auto;border:1px solid #ddd;background:#fff}
"""

# Search: the rows whose text holds every word typed stay; the count says how many.
_SCRIPT = """
(function(){
  document.querySelectorAll('input.program-search').forEach(function(box){
    var table=document.getElementById(box.dataset.table), count=document.getElementById(box.dataset.count);
    var rows=Array.prototype.slice.call(table.tBodies[0].rows);
    function filter(){
      var words=box.value.toLowerCase().split(/\\s+/).filter(function(w){return w.length>0;}), shown=0;
      rows.forEach(function(row){
        var text=row.textContent.toLowerCase(), keep=words.every(function(w){return text.indexOf(w)>=0;});
        row.hidden=!keep; if(keep){shown++;}
      });
      count.textContent=shown+' of '+rows.length+' nodes';
    }
    box.addEventListener('input',filter); filter();
  });
  document.querySelectorAll('button.toggle-all').forEach(function(button){
    button.addEventListener('click',function(){
      var all=document.querySelectorAll('#'+button.dataset.scope+' details'), open=button.dataset.open!=='1';
      all.forEach(function(d){d.open=open;}); button.dataset.open=open?'1':'0';
      button.textContent=open?'collapse all':'expand all';
    });
  });
})();
"""


def _e(value) -> str:
    return escape(str(value), quote=True)


def _row_cells(row: dict) -> str:
    return (f'<td><code>{_e(row["stmt"])}</code></td><td class="phase-{_e(row["phase"])}">{_e(row["phase"])}</td>'
            f'<td><code>{_e(row["value"])}</code></td><td class="src">{_e(row["source"])}</td>')


def _diff_table(diff: dict) -> str:
    counts = diff["counts"]
    rows = []
    for row in diff["added"]:
        rows.append(f'<tr class="add"><td>+ added</td>{_row_cells(row)}</tr>')
    for row in diff["removed"]:
        rows.append(f'<tr class="del"><td>− removed</td>{_row_cells(row)}</tr>')
    for row in diff.get("moved", ()):
        rows.append(f'<tr class="mov"><td>↕ moved</td>{_row_cells(row)}</tr>')
    for pair in diff["rewritten"]:
        rows.append(f'<tr class="mod"><td>~ was</td>{_row_cells(pair["before"])}</tr>')
        rows.append(f'<tr class="mod"><td>~ now</td>{_row_cells(pair["after"])}</tr>')
    shown = len(diff["added"]) + len(diff["removed"]) + len(diff["rewritten"]) + len(diff.get("moved", ()))
    more = sum(counts.values()) - shown
    note = f'<p class="note">{more} more changed nodes not listed</p>' if more > 0 else ""
    return ('<table class="diff"><thead><tr><th></th><th>statement</th><th>phase</th><th>value</th><th>source</th>'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table>{note}')


def _badges(diff: dict | None) -> str:
    if diff is None:
        return ""
    c = diff["counts"]
    return (f'<span class="badge b-add">+{c["added"]}</span><span class="badge b-del">−{c["removed"]}</span>'
            f'<span class="badge b-mod">~{c["rewritten"]}</span><span class="badge b-mov">↕{c.get("moved", 0)}</span>')


def _passes(data: dict, p: str) -> str:
    rows, details = [], []
    total = sum(x["seconds"] for x in data["passes"])
    for x in data["passes"]:
        what = (f"skipped ({x['skipped']})" if x["skipped"] else x["summary"] or ("changed" if x["changed"] else "no change"))
        ms = "" if x["skipped"] else f"{x['seconds'] * 1e3:.1f}"
        link = f'<a href="#{p}pass-{_e(x["label"])}">{_e(x["label"])}</a>' if x["diff"] else _e(x["label"])
        rows.append(f'<tr><td>{link}</td><td class="num">{ms}</td><td>{_e(what)}</td><td>{_badges(x["diff"])}</td></tr>')
        if x["diff"] is not None:
            details.append(f'<details class="pass" id="{p}pass-{_e(x["label"])}"><summary><b>{_e(x["label"])}</b> '
                           f'{_badges(x["diff"])} — {_e(what)} ({ms} ms)</summary>'
                           f'<div class="body">{_diff_table(x["diff"])}</div></details>')
    cached = ' <span class="note">(a plan from the cache keeps only its final graph: no diffs)</span>' if data["from_cache"] else ""
    return (f'<section id="{p}passes"><h2>Passes</h2><p>{len(data["passes"])} records, {total:.2f} s in all{cached}</p>'
            '<table class="passes"><thead><tr><th>pass</th><th>ms</th><th>what it did</th><th>nodes</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>'
            f'<h3>What each pass changed <button class="toggle-all" data-scope="{p}passes">expand all</button></h3>'
            f'{"".join(details)}</section>')


def _program(data: dict, p: str) -> str:
    rows = "".join(f'<tr><td class="num">{i}</td>{_row_cells(r)}</tr>' for i, r in enumerate(data["program"]))
    return (f'<section id="{p}program"><h2>Final program</h2>'
            f'<p><input type="search" id="{p}program-search" class="program-search" placeholder="filter: op, node, phase or source"'
            f' data-table="{p}program-table" data-count="{p}program-count" aria-label="filter the program">'
            f' <span id="{p}program-count" class="note"></span></p>'
            f'<div class="scroll"><table id="{p}program-table"><thead><tr><th>#</th><th>statement</th><th>phase</th>'
            f'<th>value</th><th>source</th></tr></thead><tbody>{rows}</tbody></table></div></section>')


def _timeline(data: dict, p: str) -> str:
    t, m = data["timeline"], data["measured"]
    figures = [f'<figure>{plots.scope_ids(plots.timeline_svg(t), p + "tl-")}</figure>']
    if m is not None and m["runs"]:
        figures.append(f'<figure>{plots.scope_ids(plots.measured_svg(m), p + "ms-")}</figure>')
        measured = (f'<p>Measured over {m["runs"]} run(s) with {_e(m["clock"])}: {m["seconds"] * 1e3:.3f} ms per step; '
                    + ", ".join(f'{_e(k)} {v * 1e3:.3f} ms' for k, v in _by_kind(m["segments"]).items()) + ".</p>")
    elif m is not None:
        measured = f'<p class="note">step.profile(steps={m["steps"]}) is armed; no run measured yet.</p>'
    else:
        measured = '<p class="note">No measurement: call <code>step.profile(steps=N)</code>, run N steps, then the report.</p>'
    model = t["device_model"]
    return (f'<section id="{p}timeline"><h2>Timeline</h2>'
            f'<p>Predicted from the plan: {t["seconds"] * 1e3:.3f} ms, {t["collectives"]} collective(s), exposed '
            f'communication {t["exposed_seconds"] * 1e3:.3f} ms. Device model (an assumption): {_e(model["name"])}.</p>'
            f'{measured}<div class="plots">{"".join(figures)}</div></section>')


def _by_kind(segments: list[dict]) -> dict:
    out: dict[str, float] = {}
    for s in segments:
        out[s["kind"]] = out.get(s["kind"], 0.0) + s["end"] - s["start"]
    return out


def _memory(data: dict, p: str) -> str:
    mem = data["memory"]
    rows = "".join(f'<tr><td class="num">{format_bytes(h["bytes"])}</td><td>{_e(h["category"])}</td>{_row_cells(h)}</tr>'
                   for h in mem["top"])
    measured = mem.get("measured_peak")
    measured_text = f' Measured peak (allocator, over the profiled runs): {format_bytes(measured)}.' if measured else ""
    peak = mem["points"][mem["peak_index"]] if mem["points"] else {}
    split = ", ".join(f'{_e(c)} {format_bytes(peak[c])}' for c in mem["categories"] if peak.get(c))
    return (f'<section id="{p}memory"><h2>Memory</h2>'
            f'<p>Predicted peak <b>{format_bytes(mem["peak"])}</b> at <code>{_e(mem["peak_node"])}</code> ({split}).'
            f'{measured_text}</p><div class="plots"><figure>{plots.scope_ids(plots.memory_svg(mem), p + "mem-")}</figure></div>'
            '<h3>Largest holders at the peak</h3><table class="holders"><thead><tr><th>bytes</th><th>category</th>'
            f'<th>statement</th><th>phase</th><th>value</th><th>source</th></tr></thead><tbody>{rows}</tbody></table></section>')


def _communication(data: dict, p: str) -> str:
    comm = data["communication"]
    if not comm:
        return f'<section id="{p}communication"><h2>Communication</h2><p>No collectives in this plan.</p></section>'
    bw = data["timeline"]["device_model"]["bus_bandwidth"]
    measured = data.get("links") or {}

    def at_link(c) -> str:
        t = c.get("measured_link_seconds")
        return f'<td class="num">{t * 1e6:.1f}</td>' if t is not None else '<td class="num">–</td>'

    rows = "".join(
        f'<tr><td>{_e(c["op"])}</td><td>{"" if c["bucket"] is None else c["bucket"]}</td><td><code>{_e(c["name"])}</code></td>'
        f'<td class="num">{format_bytes(c["payload_bytes"])}</td><td class="num">{format_bytes(c["sent_bytes"])}</td>'
        f'<td class="num">{c["predicted_seconds"] * 1e6:.1f}</td>{at_link(c)}<td class="src">{_e(c["source"])}</td></tr>'
        for c in comm)
    total = sum(c["sent_bytes"] for c in comm)
    links = ", ".join(f"{_e(k)} {v / 1e9:.1f} GB/s" for k, v in bw.items())
    if measured:
        link_text = (" Measured on this run's group by <code>step.profile</code>: "
                     + ", ".join(f"{_e(k)} {v / 1e9:.2f} GB/s" for k, v in sorted(measured.items())) + ".")
    else:
        link_text = " Not measured (<code>step.profile(steps=N)</code> on every rank measures the link)."
    return (f'<section id="{p}communication"><h2>Communication</h2><p>{len(comm)} collective(s); this rank sends '
            f'{format_bytes(total)} per step (ring). Bus bandwidth assumed: {links}.{link_text}</p>'
            '<table class="comm"><thead><tr><th>collective</th><th>bucket</th><th>node</th><th>buffer</th><th>sent</th>'
            f'<th>predicted µs</th><th>µs at the measured link</th><th>source</th></tr></thead><tbody>{rows}</tbody>'
            '</table></section>')


def _rank_section(data: dict, many: bool) -> str:
    p = f"r{data['rank']}-"
    title = f'<h2 class="rank-title">rank {data["rank"]}</h2>' if many else ""
    return (f'<section class="rank" id="{p}rank">{title}{_passes(data, p)}{_program(data, p)}{_timeline(data, p)}'
            f'{_memory(data, p)}{_communication(data, p)}</section>')


def render_page(ranks: list[dict]) -> str:
    """The whole page for one or more ranks' report data (``collect.report_data``)."""
    for data in ranks:
        if data.get("format") != FORMAT:
            raise ValueError(f"report data of format {data.get('format')!r}; this stepfx reads format {FORMAT}")
    plots.require_matplotlib()
    first = ranks[0]
    many = len(ranks) > 1
    nav_rank = f"r{first['rank']}-"
    nav = "".join(f'<a href="#{nav_rank}{s}">{s}</a>' for s in ("passes", "program", "timeline", "memory", "communication"))
    if many:
        nav += "".join(f'<a href="#r{d["rank"]}-rank">rank {d["rank"]}</a>' for d in ranks)
    who = f"ranks {', '.join(str(d['rank']) for d in ranks)}" if many else f"rank {first['rank']}"
    zero = f" · ZeRO stage {first['zero_stage']}" if first["zero_stage"] is not None else ""
    return ("<!DOCTYPE html>\n"
            f'<html lang="en"><head><meta charset="utf-8"><title>stepfx report: {_e(first["step"])}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head><body>'
            f'<header><h1>stepfx report: {_e(first["step"])}</h1>'
            f'<p>{who} of {first["world_size"]} · {_e(first["device"])}{zero} · config {_e(first["config"] or "(none)")}'
            f' · made {_e(first["made"])}</p><nav>{nav}</nav></header>'
            f'{"".join(_rank_section(d, many) for d in ranks)}<script>{_SCRIPT}</script></body></html>\n')
