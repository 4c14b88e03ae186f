"""The HTML report of the reference model's dump, rendered by headless Chromium: the first screen shows the
graph picture with fused-op boxes on it (not an empty canvas), the report's script ran and scrolled the
picture to the fused ops, and every fused op of the final stage is a box in the open picture. Skipped, with
the reason, when Chromium is not installed; slow (`pytest -m slow`)."""
import os
import re
import shutil
import signal
import subprocess

import pytest
from png_pixels import colour_counts, read_png
from reference_dump import build_reference_dump

from npu_graph import pipeline
from npu_graph.tools import html_graph, html_report, inspect_dump

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
WIDTH, HEIGHT = 1280, 900
pytestmark = [pytest.mark.slow,  # about 10 s of Chromium and PNG decoding on top of the shared reference dump
              pytest.mark.skipif(CHROMIUM is None, reason="the headless check needs Debian's chromium "
                                                          "(apt-get install chromium; .ci/run installs it)")]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """(final stage nodes, screenshot rows, DOM after the script ran)."""
    dump = build_reference_dump(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("browser")
    path = html_report.write_html_report(dump, str(tmp / "report.html"))
    shot = tmp / "first_screen.png"
    dom = chromium(f"--user-data-dir={tmp / 'profile'}", f"--screenshot={shot}", "--dump-dom", f"file://{path}")
    final = inspect_dump.show_stage(dump, None, pipeline.pass_names()[-1])["nodes"]
    width, height, rows = read_png(str(shot))
    assert (width, height) == (WIDTH, HEIGHT)
    return final, rows, dom


def chromium(*args, timeout=120):
    """Run headless Chromium in its own process group; stop that group if it hangs."""
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish in {timeout} s")
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
    return out


def box_share(rows):
    """Share of the pixels that are the fill of a node box (any class)."""
    counts = colour_counts(rows)
    fills = {bytes.fromhex(fill.lstrip("#")) for _, fill, _, _ in html_graph.CLASSES.values()}
    return sum(counts[f] for f in fills) / sum(counts.values())


def test_first_screen_shows_the_fused_ops(rendered):
    _, rows, _ = rendered
    counts = colour_counts(rows)
    fused_px = sum(counts[bytes.fromhex(html_graph.CLASSES[k][1].lstrip("#"))] for k in ("fused", "native"))
    box_px = (html_graph.BOX_W - html_graph.STRIPE - 4) * (html_graph.BOX_H - 4)
    assert fused_px >= 4 * box_px, f"fewer than 4 fused-op boxes on the first screen ({fused_px} px)"
    lower = box_share(rows[HEIGHT // 2:])
    assert lower > 0.04, f"the lower half of the first screen is an empty canvas ({lower:.1%} node boxes)"


def test_script_ran_and_every_fused_op_is_in_the_open_picture(rendered):
    final, _, dom = rendered
    assert 'data-js="ready"' in dom, "the report's script did not run"
    picture = re.search(r'<details open=""><summary>Graph picture[^<]*</summary>.*?'
                        r'<div class="scroll picture"([^>]*)>(<svg id="graph-svg-0".*?</svg>)', dom, re.S)
    assert picture, "the graph picture is not in an open <details>"
    assert 'data-focused="1"' in picture.group(1), "the picture was not scrolled to the fused ops"
    names = set(re.findall(r'<g class="node (?:fused|native)" data-name="([^"]+)"', picture.group(2)))
    assert names == {n["name"] for n in final if inspect_dump.is_fused(n)}
