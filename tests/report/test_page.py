"""step.report(path): one self-contained HTML page, and the data it is drawn from."""
import json
import os
import re
import sys
from html.parser import HTMLParser

import pytest
import torch

from stepfx.cli import main
from stepfx.explain import format_bytes
from stepfx.graph.accounting import estimate_memory
from stepfx.planning import predict
from stepfx.report import MissingPlotting, render_page, report_data
from stepfx.report.memory import memory_over_step
from stepfx.report.timeline import predicted_timeline
from tests.steps import ce_step, small_mlp

pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (the 'report' extra)")


class _Page(HTMLParser):
    """Tags, ids, links and the text of a page, as a browser's parser sees them."""

    def __init__(self):
        super().__init__()
        self.stack, self.ids, self.links, self.text = [], {}, [], []
        self.svgs = []  # the ids of the sections each inline <svg> sits in
        self.tags: dict[str, int] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if "id" in attrs:
            assert attrs["id"] not in self.ids, f"duplicate id {attrs['id']}"
            self.ids[attrs["id"]] = tag
        for key in ("src", "href", "xlink:href", "action"):
            if key in attrs:
                self.links.append(attrs[key])
        if tag == "svg":
            self.svgs.append(next((i for t, i in reversed(self.stack) if t == "section" and i), None))
        if tag not in ("meta", "input", "br", "img", "link", "path", "use", "rect", "stop") and not tag.startswith("svg:"):
            self.stack.append((tag, attrs.get("id")))

    def handle_endtag(self, tag):
        while self.stack and self.stack[-1][0] != tag:
            self.stack.pop()
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


def test_report_is_one_self_contained_page(mlp_step, tmp_path):
    path = mlp_step.report(str(tmp_path / "report.html"))
    text = open(path, encoding="utf-8").read()
    assert 20_000 < len(text) < 3_000_000
    page = _parse(text)
    assert text.startswith("<!DOCTYPE html>") and page.tags["html"] == 1 and page.tags["script"] == 1
    # nothing fetched: no external link or source, no stylesheet or image files
    assert not [link for link in page.links if link.startswith(("http:", "https:", "//"))], page.links
    assert all(link.startswith("#") for link in page.links), page.links
    assert "link" not in page.tags and "img" not in page.tags
    body = "".join(page.text)
    for record in mlp_step.plan.records:  # every pass, with what it did
        assert record.label in body
    for section in ("passes", "program", "timeline", "memory", "communication"):
        assert page.ids[f"r0-{section}"] == "section"
    # the pictures are inline SVG: the memory curve and the timeline
    assert "r0-memory" in page.svgs and "r0-timeline" in page.svgs
    # every node of the final program is a row
    assert text.count("<tr><td class=\"num\">") >= len(mlp_step.plan.graph.gm.graph.nodes) - 1


def test_a_pass_that_changed_the_graph_has_its_diff(mlp_step):
    data = report_data(mlp_step)
    passes = {p["name"]: p for p in data["passes"]}
    drop = passes["drop_profiler_nodes"]  # AdamW's record_function markers: removed, nothing else
    assert drop["changed"] and drop["diff"]["counts"]["removed"] == len(drop["diff"]["removed"]) > 0
    assert drop["diff"]["counts"]["added"] == 0
    assert all("profiler" in row["stmt"] for row in drop["diff"]["removed"])
    functionalized = passes["functionalize_graph"]["diff"]  # in-place optimizer ops rewritten out of place
    assert functionalized["counts"]["added"] > 0 and any(r["source"] for r in functionalized["added"])
    unchanged = [p for p in data["passes"] if not p["changed"]]
    assert unchanged and all(p["diff"] is None for p in unchanged)
    page = _parse(render_page([data]))
    assert page.ids[f"r0-pass-{drop['label']}"] == "details"
    assert f"r0-pass-{unchanged[0]['label']}" not in page.ids


def test_memory_curve_peak_is_explains_peak(mlp_step):
    memory = report_data(mlp_step)["memory"]
    peak = estimate_memory(mlp_step.plan.graph).peak
    assert memory["peak"] == peak == max(sum(p[c] for c in memory["categories"]) for p in memory["points"])
    assert f"{format_bytes(peak):>12}  (at {memory['peak_node']})" in mlp_step.explain()
    # the holders at the peak: parameters and optimizer state (AdamW's moments) among them
    assert {h["category"] for h in memory["top"]} >= {"parameters", "optimizer state"}
    assert sorted((h["bytes"] for h in memory["top"]), reverse=True) == [h["bytes"] for h in memory["top"]]


def test_timeline_has_one_event_per_collective_and_memory_matches_the_prediction():
    batch = torch.empty(6, 8, device="meta"), torch.empty(6, dtype=torch.long, device="meta")
    p = predict(ce_step, {"zero_optimization": {"stage": 3}, "gradient_clipping": 0}, small_mlp, *batch,
                world_size=2, device="cpu")
    timeline = predicted_timeline(p.graph, "cpu", 2)
    comm = [e for e in timeline["events"] if e["stream"].startswith("comm")]
    assert [(e["op"], e["node"], e["bytes"]) for e in comm] == [(c.op, c.node, c.payload_bytes) for c in p.collectives]
    assert comm
    for e in timeline["events"]:
        assert 0 <= e["start"] <= e["end"] <= timeline["seconds"]
    assert memory_over_step(p.graph)["peak"] == p.memory.peak


def test_measured_timeline_after_profile(mlp_step):
    measured = report_data(mlp_step)["measured"]
    assert measured["runs"] == 2 and measured["clock"] == "the host clock"
    kinds = [s["kind"] for s in measured["segments"]]
    assert {"forward", "backward", "optimizer"} <= set(kinds)
    assert all(a["end"] <= b["start"] + 1e-12 for a, b in zip(measured["segments"], measured["segments"][1:]))
    assert mlp_step.plan.executor.timer is None  # put back after the two runs


def test_report_html_from_a_dump_directory(mlp_step, tmp_path, capsys):
    paths = mlp_step.dump(str(tmp_path / "dump"))
    assert os.path.basename(paths[-1]) == "report.json"
    assert json.load(open(paths[-1]))["step"] == "ce_step"
    out = tmp_path / "page.html"
    assert main(["report-html", str(tmp_path / "dump"), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert "stepfx report: ce_step" in out.read_text()
    assert main(["report-html", str(tmp_path / "nothing")]) == 2
    assert "no report.json" in capsys.readouterr().err


def test_without_matplotlib_the_error_names_the_extra(mlp_step, monkeypatch):
    data = report_data(mlp_step)  # the data needs no matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPlotting, match=r"stepfx\[report\]"):
        render_page([data])


def test_a_collective_report_holds_every_rank(rank_pool, tmp_path):
    """Called by every rank with all_ranks=True: rank 0 writes one page with each rank's sections
    (its own program, memory and collectives), the others write nothing."""
    from tests.report.report_workers import zero3_gpt_report

    path = str(tmp_path / "zero3.html")
    results = rank_pool(2).run(zero3_gpt_report, path, timeout=300)
    assert results == [path, None]
    html = open(path).read()
    assert "ranks 0, 1 of 2" in html and "ZeRO stage 3" in html
    for rank in (0, 1):
        for section in ("passes", "program", "timeline", "memory", "communication"):
            assert f'id="r{rank}-{section}"' in html, (rank, section)
    assert html.count("all_gather") >= 2  # each rank's collectives listed
    # step.profile measured the link on the step's group: each collective's time at that rate
    assert html.count("by <code>step.profile</code>: all_gather") == 2  # one line per rank
    cells = re.findall(r'<td class="num">([0-9.]+|–)</td><td class="src">', html)
    assert cells and "–" not in cells and any(float(c) > 0 for c in cells)
