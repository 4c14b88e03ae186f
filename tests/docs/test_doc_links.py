"""What README.md and docs/ point at exists: every relative link (and its #anchor), every `ascend-dsa ...` command
with its flags (checked against the `--help` of the sub-command it names; a bench suite against the suites the
command line has), and a row in docs/passes.md for every pass of the pipeline."""
import contextlib
import io
import re
from pathlib import Path

import pytest

from npu_graph.pipeline import pass_names
from npu_graph.tools import cli
from npu_graph.tools.bench import SUITES
from tests.docs.markdown import DOCS, ROOT, anchors, commands, documents, links, sections

INSPECT_VIEWS = ("show", "diff", "html")


def _relative(target: str) -> bool:
    return not re.match(r"[a-z]+:", target)


def test_every_relative_link_and_anchor_exists():
    broken = []
    for doc in documents():
        for line, target in links(doc):
            if not _relative(target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}:{line}: {target}"
            if not file.is_relative_to(ROOT) or not file.exists():
                broken.append(f"{where} (no such file in the repository)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def _help(words: list[str]) -> str | None:
    """The --help text of `ascend-dsa WORDS`, or None when the command line does not know WORDS."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli._parser().parse_args([*words, "--help"])
        except SystemExit as e:
            return out.getvalue() if e.code == 0 else None
    return None


def _placeholder(word: str) -> bool:
    return not re.fullmatch(r"[a-z][a-z0-9_-]*", word)


def _not_yet_measured(doc: Path, line: int) -> bool:
    """Whether `line` of `doc` lies in a docs/RESULTS.md section marked "not yet measured", which may name a bench
    suite this checkout does not have."""
    if doc != DOCS / "RESULTS.md":
        return False
    text = doc.read_text()
    title = re.findall(r"^## (.+)$", "\n".join(text.split("\n")[:line]), re.M)[-1:]
    return bool(title) and "status: not yet measured" in sections(text)[title[0]]


def _problem(doc: Path, line: int, args: str) -> str | None:
    words = args.split()
    command = [w for w in words[:1] if not _placeholder(w)]
    if command and command[0] == "bench" and len(words) > 1 and not _placeholder(words[1]):
        if words[1] not in SUITES and not _not_yet_measured(doc, line):
            return f"no bench suite {words[1]!r} (suites: {', '.join(SUITES)})"
    elif command and command[0] in ("cache", "inspect") and len(words) > 1 and not _placeholder(words[1]):
        command.append(words[1] if command[0] == "cache" or words[1] in INSPECT_VIEWS else "show")
    elif command and command[0] == "inspect":
        command.append("show")
    text = _help(command)
    if text is None:
        return f"`ascend-dsa {' '.join(command)}` is not a command"
    missing = [f for f in re.findall(r"--[a-z][a-z0-9-]*", args) if f not in text.split()
               and not re.search(rf"{f}[ =,\]]", text)]
    return f"no option {', '.join(missing)} in `ascend-dsa {' '.join(command)} --help`" if missing else None


def test_every_command_named_exists():
    found = [(doc, line, args) for doc in documents() for line, args in commands(doc)]
    assert len(found) > 20
    problems = [f"{doc.relative_to(ROOT)}:{line}: ascend-dsa {args}: {problem}" for doc, line, args in found
                if (problem := _problem(doc, line, args))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("args", ["bench nosuch", "nosuch", "demo --no-such-flag", "cache frobnicate"])
def test_a_command_that_does_not_exist_is_found(args):
    assert _problem(ROOT / "README.md", 1, args)


def test_every_pass_of_the_pipeline_has_a_row_in_passes_md():
    rows = [line.split("|")[1] for line in (DOCS / "passes.md").read_text().split("\n") if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert set(pass_names()) - documented == set()
