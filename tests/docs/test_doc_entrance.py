"""The entrance check: README.md and docs/ describe the product as it is. A line that tells how the work was
organized (sessions, numbered work periods, issue numbers, acceptance scripts) or names a path outside the
repository fails the test, listed as path:line."""
import re
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, documents

HISTORY = [
    (re.compile(r"\bsessions?\b", re.I), "a work session"),
    (re.compile(r"\b(work period|sprint|wave)s?\b", re.I), "a work period"),
    (re.compile(r"\bissues?[ -]?#?\d+", re.I), "an issue number"),
    (re.compile(r"\bacceptance\b(?![ _]rate)", re.I), "acceptance scripts or checks"),
    (re.compile(r"\bi\d\d_[a-z]\w*"), "an acceptance script's name"),
]
OUTSIDE = [
    (re.compile(r"(?:^|[\s`(\"'])(/work/|/home/|~/shared\b|\.acc/)"), "a path outside the repository"),
]
_PARENT = re.compile(r"(?<![\w.])((?:\.\./)+)([\w.-]*)")


def offences(path: Path, text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.split("\n"), 1):
        reasons = [why for pattern, why in HISTORY + OUTSIDE if pattern.search(line)]
        for m in _PARENT.finditer(line):
            if not (path.parent / m.group(1)).resolve().is_relative_to(ROOT):
                reasons.append(f"a path outside the repository ({m.group(0)})")
        found += [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}: {why}: {line.strip()}"
                  for why in reasons]
    return found


def test_no_line_of_readme_or_docs_tells_history_or_leaves_the_repository():
    bad = [o for doc in documents() for o in offences(doc, doc.read_text())]
    assert not bad, "offending lines:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", [
    "measured in the fifth session", "as issue 18 asks", "see Issue #7", "the acceptance check runs it",
    "`../shared/acceptance/run.sh`", "`i12_generate.py --mid`", "copied to .acc/run.sh", "under /work/notes",
    "the second wave of changes"])
def test_the_check_finds_history_and_outside_paths(line):
    assert offences(ROOT / "README.md", line)


@pytest.mark.parametrize("line", [
    "the acceptance rate falls with depth", "`stats.acceptance_rate`", "[design](docs/DESIGN.md)",
    "writes /tmp/ascend_dsa_dump", "issues a warning", "in the second graph"])
def test_the_check_passes_what_the_product_says(line):
    assert not offences(ROOT / "README.md", line)


def test_a_link_up_out_of_docs_is_outside_but_one_to_the_root_is_not():
    assert not offences(ROOT / "docs" / "x.md", "[readme](../README.md)")
    assert offences(ROOT / "docs" / "x.md", "[notes](../../notes.md)")
