"""`ascend-dsa inspect html`: one self-contained file; the graph picture shows the work (fused ops, native
kernels, SuperKernel regions) with a short legend; the plan sections are tables, never a JSON blob.
Checked as text on the reference model's dump and on a synthetic dump with every later-pass field (the
headless-browser check is test_html_report_browser.py)."""
import json
import pathlib
import re
import subprocess
import sys

import pytest
from reference_dump import build_reference_dump

from npu_graph import pipeline
from npu_graph.tools import html_graph, html_report, html_tables, inspect_dump
from npu_graph.tools.html_timeline import timeline_svg


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    dump = build_reference_dump(tmp_path_factory)
    out = tmp_path_factory.mktemp("html") / "report.html"
    p = subprocess.run([sys.executable, "-m", "npu_graph", "inspect", "html", dump, "-o", str(out), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["report"] == str(out)
    return dump, str(out), out.read_text()


def svg(text, svg_id):
    match = re.search(rf'<svg id="{svg_id}".*?</svg>', text, re.S)
    assert match, f"no svg #{svg_id}"
    return match.group(0)


def boxes(picture, klass=None):
    """data-name of every node box (of one class) in a picture."""
    pattern = rf'<g class="node {klass or "[a-z]+"}" data-name="([^"]+)"'
    return re.findall(pattern, picture)


def plan(text, key):
    match = re.search(rf'<details open class="plan" id="plan-{key}">(.*?)</details>', text, re.S)
    assert match, f"no open plan section {key}"
    return match.group(1)


def final_nodes(dump):
    return inspect_dump.show_stage(dump, None, pipeline.pass_names()[-1])["nodes"]


def test_report_is_one_self_contained_file(report):
    _, _, text = report
    tags = set(re.findall(r"<([a-z0-9]+)[\s>]", text))
    assert {"svg", "table", "details", "script", "style", "input"} <= tags
    assert not tags & {"link", "img", "iframe", "object", "embed"}
    assert not re.search(r'\s(src|href|action|poster|srcset)="(?!#)', text)
    assert not any(s in text for s in ("http://", "https://", "url(", "@import", "//cdn"))


def test_picture_shows_every_fused_op_and_leaves_out_plumbing(report):
    dump, _, text = report
    final = final_nodes(dump)
    picture = svg(text, "graph-svg-0")
    fused = {n["name"] for n in final if inspect_dump.is_fused(n)}
    shown = set(boxes(picture))
    assert fused and fused == set(boxes(picture, "fused")) | set(boxes(picture, "native"))
    plumbing = {n["name"] for n in final if html_graph.is_plumbing(n)}
    assert not shown & plumbing and len(shown) == len(final) - len(plumbing)
    assert f"{len(plumbing)} inputs, getitem, view and stream-event nodes left out" in text
    assert re.search(r'class="scroll picture" data-focus-x="\d+" data-focus-y="\d+"', text)


def test_every_node_picture_is_capped(report):
    dump, _, text = report
    final = final_nodes(dump)
    full = svg(text, "graph-full-svg-0")
    assert len(boxes(full)) == html_graph.MAX_SVG_NODES < len(final)
    assert f"showing {html_graph.MAX_SVG_NODES} of {len(final)} nodes" in text


def test_timeline_without_stream_plan_is_the_serial_order(report):
    dump, _, text = report
    timeline = svg(text, "timeline-svg-0")
    assert "no stream plan: serial order" in timeline
    assert timeline.count('class="bar"') == sum(n["op"] == "call_function" for n in final_nodes(dump))


def test_passes_diffs_and_plan_sections(report):
    _, _, text = report
    assert "canonical_form → canonicalize" in text and "removed" in text and "rewired" in text
    for title in ("Passes", "Per-pass diffs", "Quantization", "Layouts", "SuperKernels", "Implementations",
                  "Near misses", "Stream plan"):
        assert f"<summary>{title}</summary>" in text
    assert 'id="search"' in text and "&quot;" not in plan(text, "layouts")


def node(name, target, args=(), **meta):
    op = "call_function" if "." in target else ("call_module" if target.startswith("superkernel") else target)
    return {"name": name, "op": op, "target": target, "args": list(args), "kwargs": {},
            "shapes": [["4", "8"]], "dtypes": ["float32"], "created_by": "capture", **meta}


def write_stage(folder, index, stage, nodes, **record):
    (folder / f"{index:02d}_{stage}.json").write_text(json.dumps({"stage": stage, **record, "nodes": nodes}))
    (folder / f"{index:02d}_{stage}.txt").write_text(f"stage {stage}\n")


PLANNED_SUMMARY = {
    "graph": "graph_0", "nodes_before": 6, "nodes_after": 8, "cache": "miss", "cache_reason": "",
    "fused_ops": {"lightning_indexer": 1, "dynamic_mx_quant": 1, "rms_norm": 1}, "timings_ms": {"compile": 12.5},
    "passes": [{"name": "fuse_indexer", "changed": True, "skipped": None, "nodes": 8, "ms": 1.0,
                "stats": {"matches": {"indexer": 1}}},
               {"name": "quantize", "changed": False, "skipped": "disabled", "nodes": 8, "ms": 0, "stats": {}}],
    "streams": {"count": 2, "makespan_serial": 6, "makespan": 6, "prologs": [],
                "nodes": {"mm": {"stream": 0, "start": 0, "end": 2}, "q": {"stream": 1, "start": 2, "end": 3},
                          "idx": {"stream": 0, "start": 3, "end": 6}}},
    "superkernels": {"count": 1, "enabled": True, "regions": [{"name": "superkernel_0", "stream": 0, "ops": 5,
                                                                "nodes": 7}]},
    "quantized": {"policy": {"indexer": "mxfp8", "kv": "none"},
                  "tensors": [{"op": "lightning_indexer", "node": "idx", "tensor": "query", "format": "mxfp8_e4m3",
                               "group": 32}]},
    "layouts": {"weights": [{"weight": "w", "shape": [32, 64], "format": "FRACTAL_NZ", "fractal": [16, 16],
                             "reason": "frozen matmul weight", "consumers": ["aten.mm.default"]}],
                "counts": {"FRACTAL_NZ": 1}, "cpu_realised": 1},
    "implementations": [{"node": "norm", "op": "rms_norm", "impl": "native", "why": "measured"},
                        {"node": "idx", "op": "lightning_indexer", "impl": "torch", "why": "no native kernel"}],
    "near_misses": [{"pass": "fuse_rms_norm", "pattern": "x·rsqrt(mean(x²)+eps)", "node": "mul_3",
                     "reason": "the tensor normalized is not the one squared"}],
}


@pytest.fixture
def planned_dump(tmp_path):
    """A dump as the later passes write it: fused ops, a native kernel, a SuperKernel region, two streams,
    quantization, layouts, implementations and a near miss; and a graph loaded from the cache."""
    g = tmp_path / "000_graph_0_1"
    g.mkdir()
    before = [node("x", "placeholder"), node("w", "placeholder"), node("mm", "aten.mm.default", ["x", "w"]),
              node("relu", "aten.relu.default", ["mm"]), node("topk", "aten.topk.default", ["relu"]),
              node("output", "output", ["(topk,)"])]
    after = [*before[:2], node("mm", "aten.mm.default", ["x", "w"], stream=0),
             node("mm_view", "aten.view.default", ["mm", "[4, 8]"]),
             node("norm", "ascend_dsa.rms_norm.default", ["mm_view", "w"], created_by="fuse_rms_norm"),
             node("q", "ascend_dsa.dynamic_mx_quant.default", ["norm"], created_by="quantize", stream=1,
                  quant={"format": "mxfp8", "group": 32}),
             node("superkernel_0", "superkernel_0", ["q"], created_by="partition_superkernels", superkernel=0),
             node("getitem", "<built-in function getitem>", ["superkernel_0", "0"], superkernel=0),
             node("idx", "ascend_dsa.lightning_indexer.default", ["getitem", "w"], created_by="fuse_indexer",
                  stream=0, layout={"format": "FRACTAL_NZ", "fractal": [16, 16]}),
             node("output", "output", ["(idx,)"])]
    write_stage(g, 0, "captured", before)
    write_stage(g, 1, "partition_superkernels", after, changed=True)
    (g / "summary.json").write_text(json.dumps(PLANNED_SUMMARY))
    hit = tmp_path / "001_graph_1_1"
    hit.mkdir()
    (hit / "summary.json").write_text(json.dumps({"graph": "graph_1", "cache": "hit", "cache_reason": "same key"}))
    return tmp_path


@pytest.fixture
def planned_text(planned_dump, tmp_path):
    return pathlib.Path(html_report.write_html_report(str(planned_dump), str(tmp_path / "r.html"))).read_text()


def test_picture_classes_edges_and_streams(planned_text):
    picture = svg(planned_text, "graph-svg-0")
    assert boxes(picture) == ["mm", "norm", "q", "superkernel_0", "idx"]
    assert boxes(picture, "native") == ["norm"] and boxes(picture, "fused") == ["q", "idx"]
    assert boxes(picture, "superkernel") == ["superkernel_0"] and "superkernel_0 · 5 ops" in picture
    assert picture.count("<path") == 4, "mm→norm through the view, q→superkernel_0→idx through the getitem"
    stripe = rf'width="{html_graph.STRIPE}" height="{html_graph.BOX_H}" fill="(#\w+)"'
    stripes = {}
    for box in picture.split('<g class="node ')[1:]:
        found = re.search(stripe, box)
        stripes[re.search(r'data-name="(\w+)"', box).group(1)] = found and found.group(1)
    assert stripes["mm"] == stripes["idx"] == html_graph.STREAM_FILLS[0] != stripes["q"]
    assert stripes["norm"] is None and stripes["superkernel_0"] is None


def test_legend_is_short_and_counts_the_classes(planned_text):
    legend = re.search(r'<div class="legend">(.*?)</div>', planned_text, re.S).group(1)
    entries = re.findall(r"<span>", legend)
    assert len(entries) <= len(html_graph.CLASSES) + 1 + 2
    for label in ("fused op, native kernel (1)", "fused op (torch implementation) (2)", "SuperKernel region (1)",
                  "other op (1)", "stream 0", "stream 1"):
        assert label in legend


def test_plan_sections_are_tables_not_json(planned_text):
    layouts, quant, misses = (plan(planned_text, k) for k in ("layouts", "quantized", "near_misses"))
    assert "<h4>weights (1)</h4><table>" in layouts and "<th>fractal</th>" in layouts
    assert "<td>[16, 16]</td>" in layouts and "FRACTAL_NZ: 1" in layouts
    assert "<h4>tensors (1)</h4><table>" in quant and "mxfp8_e4m3" in quant and "indexer: mxfp8; kv: none" in quant
    assert "<th>reason</th>" in misses and "the tensor normalized is not the one squared" in misses
    implementations = plan(planned_text, "implementations")
    assert implementations.count("<tr") == 3 and "<td>native</td>" in implementations
    body = planned_text.split("<script>")[0]
    assert not re.search(r"&quot;\w+&quot;:|\{&quot;|\[\{", body), "a JSON blob is in the report"
    assert "loaded from the compile cache" in planned_text and "disabled" in planned_text


def test_timeline_has_a_lane_per_stream(planned_text):
    timeline = svg(planned_text, "timeline-svg-0")
    assert timeline.count('class="bar"') == 3 and "one lane per stream" in timeline
    assert "stream 1</text>" in timeline and "makespan 6" in planned_text
    assert timeline_svg([], None, "t").count('class="bar"') == 0


def test_section_shapes():
    assert html_tables.section(None, "absent") == "<p>absent</p>"
    assert html_tables.section([], empty="none") == "<p>none</p>"
    nested = html_tables.section({"a": 1, "rows": [{"k": 1, "v": {"x": [1, 2]}}], "more": {"p": {"q": 2}}})
    assert nested.count("<table") == 3 and "<td>x: [1, 2]</td>" in nested
    assert html_tables.cell({"matches": {"conv": 2}, "near": []}) == "matches: {conv: 2}; near: -"
    long = html_tables.section([{"i": i} for i in range(html_tables.SCROLL_ROWS + 1)])
    assert long.startswith('<div class="scroll">')
    assert html_tables.cell(17476.637) == "17477" and html_tables.cell(0.20421) == "0.2042"
    assert html_tables.cell(list(range(20))).endswith("… (20 in all)]")


def test_large_graph_shows_the_fused_neighbourhood_first():
    nodes = [node("x", "placeholder")] + [node(f"n{i}", "aten.relu.default", [f"n{i - 1}" if i else "x"])
                                           for i in range(1000)]
    names = [n["name"] for n in nodes]
    edges = html_graph.data_edges(nodes, set(names))
    shown = html_graph.select_nodes(names, edges, {"n700"}, cap=50)
    assert len(shown) == 50 and {"n699", "n700", "n701"} <= set(shown) and "n0" not in shown
    kept = [(s, d) for s, d in edges if s in shown and d in shown]
    assert len(kept) == 49 and len(set(html_graph.layout_nodes(shown, kept).values())) == 50


def test_focus_is_the_densest_band_of_fused_ops():
    points = [(10.0, 0.0)] + [(300.0 + i, 2000.0 + 30 * i) for i in range(5)]
    x, y = html_graph.focus_point(points)
    assert y == 2000.0 and 300 < x < 305 + html_graph.BOX_W
    assert html_graph.focus_point([]) is None
