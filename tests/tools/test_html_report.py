"""`ascend-dsa inspect html`: one self-contained file with the graph picture, the stream timeline and the
plan tables, checked as text, on a synthetic dump with every later-pass field, and in headless Chromium
(skipped with the reason when Chromium is not installed)."""
import json
import os
import pathlib
import re
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser

import pytest
from reference_dump import build_reference_dump

from npu_graph import pipeline
from npu_graph.tools import html_report, inspect_dump

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


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


class Refs(HTMLParser):
    """Every tag and every attribute that could load something."""

    def __init__(self):
        super().__init__()
        self.tags, self.refs = set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "xlink:href", "action", "poster", "srcset")]


def test_report_is_one_self_contained_file(report):
    _, _, text = report
    parser = Refs()
    parser.feed(text)
    assert {"svg", "table", "details", "script", "style", "input"} <= parser.tags
    assert not parser.tags & {"link", "img", "iframe", "object", "embed"}
    assert all(ref.startswith("#") for ref in parser.refs), parser.refs
    assert not any(s in text for s in ("http://", "https://", "url(", "@import", "//cdn"))


def test_graph_picture_is_capped_and_focused(report):
    dump, _, text = report
    final = inspect_dump.show_stage(dump, None, pipeline.pass_names()[-1])["nodes"]
    picture = svg(text, "graph-svg-0")
    assert picture.count('<g class="node"') == html_report.MAX_SVG_NODES < len(final)
    assert picture.count("<path") > 100 and f"showing 400 of {len(final)} nodes" in text
    assert "fused ascend_dsa op" in text and "created by a pass" in text


def test_timeline_without_stream_plan_is_the_serial_order(report):
    dump, _, text = report
    final = inspect_dump.show_stage(dump, None, pipeline.pass_names()[-1])["nodes"]
    timeline = svg(text, "timeline-svg-0")
    assert "no stream plan: serial order" in timeline
    assert timeline.count('class="bar"') == sum(n["op"] == "call_function" for n in final)


def test_passes_diffs_and_plan_tables(report):
    _, _, text = report
    assert "captured → canonicalize" in text and "removed" in text and "rewired" in text
    for title in ("Passes", "Per-pass diffs", "Quantization", "Layouts", "SuperKernels", "Near misses"):
        assert f"<summary>{title}</summary>" in text
    assert "not planned" in text and 'id="search"' in text


def node(name, target, args=(), **meta):
    return {"name": name, "op": "call_function" if "." in target else target, "target": target,
            "args": list(args), "kwargs": {}, "shapes": [["4", "8"]], "dtypes": ["float32"],
            "created_by": "capture", **meta}


def write_stage(folder, index, stage, nodes, **record):
    (folder / f"{index:02d}_{stage}.json").write_text(json.dumps({"stage": stage, **record, "nodes": nodes}))
    (folder / f"{index:02d}_{stage}.txt").write_text(f"stage {stage}\n")


@pytest.fixture
def planned_dump(tmp_path):
    """A dump as the later passes write it: fused ops, streams, superkernels, quantization, layouts."""
    g = tmp_path / "000_graph_0_1"
    g.mkdir()
    before = [node("x", "placeholder"), node("w", "placeholder"), node("mm", "aten.mm.default", ["x", "w"]),
              node("relu", "aten.relu.default", ["mm"]), node("topk", "aten.topk.default", ["relu"]),
              node("output", "output", ["(topk,)"])]
    after = [*before[:3], node("q", "ascend_dsa.dynamic_mx_quant.default", ["mm"], created_by="quantize",
                               stream=1, superkernel="sk0", quant={"format": "mxfp8", "group": 32}),
             node("idx", "ascend_dsa.lightning_indexer.default", ["q", "w"], created_by="fuse_indexer",
                  stream=0, superkernel="sk0", layout="NZ"),
             node("output", "output", ["(idx,)"])]
    after[2] = {**after[2], "stream": 0, "layout": "NZ"}
    write_stage(g, 0, "captured", before)
    write_stage(g, 1, "fuse_indexer", after, changed=True)
    plan = {"mm": {"stream": 0, "start": 0, "end": 2}, "q": {"stream": 1, "start": 2, "end": 3},
            "idx": {"stream": 0, "start": 3, "end": 6}}
    summary = {"graph": "graph_0", "nodes_before": 6, "nodes_after": 6, "cache": "miss", "cache_reason": "",
               "fused_ops": {"lightning_indexer": 1, "dynamic_mx_quant": 1}, "timings_ms": {"compile": 12.5},
               "passes": [{"name": "fuse_indexer", "changed": True, "skipped": None, "nodes": 6, "ms": 1.0,
                           "stats": {"matches": 1}},
                          {"name": "quantize", "changed": False, "skipped": "disabled", "nodes": 6, "ms": 0,
                           "stats": {}}],
               "streams": {"count": 2, "makespan_serial": 6, "makespan": 6, "nodes": plan},
               "superkernels": [{"name": "sk0", "nodes": ["q", "idx"]}],
               "quantized": {"indexer.q": {"format": "mxfp8", "group": 32}},
               "layouts": {"w": "NZ"}, "near_misses": [{"pattern": "indexer", "reason": "no relu"}]}
    (g / "summary.json").write_text(json.dumps(summary))
    hit = tmp_path / "001_graph_1_1"
    hit.mkdir()
    (hit / "summary.json").write_text(json.dumps({"graph": "graph_1", "cache": "hit", "cache_reason": "same key"}))
    return tmp_path


def test_planned_dump_colours_streams_superkernels_and_fused_ops(planned_dump, tmp_path):
    path = html_report.write_html_report(str(planned_dump), str(tmp_path / "r.html"))
    text = pathlib.Path(path).read_text()
    picture, timeline = svg(text, "graph-svg-0"), svg(text, "timeline-svg-0")
    assert picture.count('<g class="node"') == 6 and picture.count(f'stroke="{html_report.FUSED_STROKE}"') == 2
    assert "stream 0" in text and "stream 1" in text and "superkernel sk0" in text
    assert timeline.count('class="bar"') == 3 and "one lane per stream" in timeline
    assert "stream 1</text>" in timeline and "no stream plan" not in timeline
    assert "mxfp8" in text and "indexer.q" in text and "no relu" in text and "makespan 6" in text
    assert "loaded from the compile cache" in text and "disabled" in text
    diff = inspect_dump.diff(str(planned_dump), "captured", "1", "graph_0")
    assert [r["pass"] for r in diff["fused_regions"]] == ["fuse_indexer"]


def test_large_graph_shows_the_fused_neighbourhood_first():
    nodes = [node("x", "placeholder")] + [node(f"n{i}", "aten.relu.default", [f"n{i - 1}" if i else "x"])
                                           for i in range(1000)]
    nodes[700]["target"] = "ascend_dsa.rms_norm.default"
    shown = {n["name"] for n in html_report.select_nodes(nodes, {"n700"}, cap=50)}
    assert len(shown) == 50 and {"n699", "n700", "n701"} <= shown and "n0" not in shown
    _, edges = html_report.layout_nodes([n for n in nodes if n["name"] in shown])
    assert len(edges) == 49


def chromium(*args, timeout=120):
    """Run headless Chromium in its own process group; stop that group if it hangs."""
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", "--window-size=1400,1000", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish in {timeout} s")
    return out


def unfilter(kind, row, prev, bpp):
    if kind == 1:
        for i in range(bpp, len(row)):
            row[i] = (row[i] + row[i - bpp]) & 255
    elif kind == 2:
        row[:] = bytes((a + b) & 255 for a, b in zip(row, prev))
    elif kind in (3, 4):
        for i in range(len(row)):
            a, b, c = (row[i - bpp] if i >= bpp else 0), prev[i], (prev[i - bpp] if i >= bpp else 0)
            if kind == 3:
                row[i] = (row[i] + ((a + b) >> 1)) & 255
                continue
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255


def png_colours(path):
    """Distinct RGB colours of an 8-bit RGB or RGBA PNG (a tiny reader: zlib and the five row filters)."""
    data, pos, idat = pathlib.Path(path).read_bytes(), 8, b""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", data[pos + 8:pos + 18])
        elif kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    assert depth == 8 and colour_type in (2, 6)
    bpp = 3 if colour_type == 2 else 4
    raw, stride, colours = zlib.decompress(idat), width * bpp, set()
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        row = bytearray(raw[start + 1:start + 1 + stride])
        unfilter(raw[start], row, prev, bpp)
        colours.update(bytes(row[i:i + 3]) for i in range(0, stride, bpp))
        prev = row
    return colours


def rgb(hex_colour):
    return bytes.fromhex(hex_colour.lstrip("#"))


@pytest.mark.skipif(CHROMIUM is None, reason="headless check needs Debian's chromium (apt-get install chromium; "
                                              ".ci/run installs it)")
def test_report_renders_in_headless_chromium(report, tmp_path):
    _, path, _ = report
    shot = tmp_path / "shot.png"
    chromium(f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", f"file://{path}")
    assert shot.exists() and shot.stat().st_size > 10_000
    colours = png_colours(shot)
    assert len(colours) > 50, "the screenshot is blank"
    assert rgb(html_report.NEUTRAL_FILL) in colours, "graph picture boxes are not on screen"
    assert rgb(html_report.STREAM_FILLS[0]) in colours, "timeline lane is not on screen"
    dom = chromium(f"--user-data-dir={tmp_path / 'profile2'}", "--dump-dom", f"file://{path}")
    assert 'data-js="ready"' in dom, "the report's script did not run"
    assert svg(dom, "graph-svg-0").count("<rect") >= html_report.MAX_SVG_NODES
    assert svg(dom, "timeline-svg-0").count("<rect") > 100
