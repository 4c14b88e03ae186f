"""docs/RESULTS.md is a set of current tables: a section per benchmark of the command line, and before every table a
header block naming the command that prints it, the CPU, the ISA level, the cores and the date:

    - command: `ascend-dsa bench e2e --quick --json`
    - CPU: AMD EPYC (Zen 4, family 25 model 17)
    - ISA: avx512_bf16
    - cores: 2
    - date: 2026-12-04

A benchmark with no figures yet has its section with `- command:` and `- status: not yet measured on this
machine`, and no table."""
import datetime
import re

import pytest

from npu_graph.kernels.native.cpu_isa import LEVELS
from npu_graph.tools.bench import SUITES
from tests.docs.markdown import DOCS, sections

RESULTS = DOCS / "RESULTS.md"
FIELDS = ("command", "CPU", "ISA", "cores", "date")
_FIELD = re.compile(r"^- (command|CPU|ISA|cores|date|status): (.+)$")


def header_problems(header: dict[str, str]) -> list[str]:
    """What a table's header block lacks or gets wrong."""
    problems = [f"no {f}" for f in FIELDS if not header.get(f, "").strip()]
    if "ascend-dsa " not in header.get("command", ""):
        problems.append("the command is not an `ascend-dsa ...` command")
    if header.get("ISA") and not any(re.search(rf"\b{level}\b", header["ISA"]) for level in LEVELS):
        problems.append(f"ISA names none of the levels {LEVELS}")
    if header.get("cores") and not re.fullmatch(r"\d+", header["cores"].strip()):
        problems.append("cores is not a count")
    try:
        datetime.date.fromisoformat(header.get("date", "").strip())
    except ValueError:
        problems.append("date is not YYYY-MM-DD")
    return problems


def section_problems(title: str, body: str) -> list[str]:
    problems, header, in_table, tables = [], None, False, 0
    for line in body.split("\n"):
        field = _FIELD.match(line)
        if field:
            header = {} if field.group(1) == "command" or header is None else header
            header[field.group(1)] = field.group(2)
        is_row = line.startswith("|")
        if is_row and not in_table:
            tables += 1
            if header is None or "status" in header:
                problems.append(f"{title}: table {tables} has no header block before it")
            else:
                problems += [f"{title}: table {tables}: {p}" for p in header_problems(header)]
        in_table = is_row
    if header is not None and "status" in header and "not yet measured" not in header["status"]:
        problems.append(f"{title}: a status other than not yet measured")
    if tables == 0 and not (header and "not yet measured" in header.get("status", "")):
        problems.append(f"{title}: no table and not marked not yet measured")
    command = (header or {}).get("command", "").replace("`", " ").split()
    if title.startswith("bench ") and title.split()[1] not in command:
        problems.append(f"{title}: the header's command is not this suite's")
    return problems


def test_every_table_of_results_names_command_cpu_isa_cores_and_date():
    problems = [p for title, body in sections(RESULTS.read_text()).items() for p in section_problems(title, body)]
    assert not problems, "\n".join(problems)


def test_every_bench_suite_has_a_section():
    titles = set(sections(RESULTS.read_text()))
    assert {f"bench {suite}" for suite in SUITES} - titles == set()


GOOD = """- command: `ascend-dsa bench cp --json`
- CPU: AMD EPYC
- ISA: avx2
- cores: 2
- date: 2026-12-02

| a | b |
|---|---|
| 1 | 2 |"""


@pytest.mark.parametrize(("edit", "problem"), [
    (lambda s: s.replace("- CPU: AMD EPYC\n", ""), "no CPU"),
    (lambda s: s.replace("avx2", "sse9"), "ISA names none"),
    (lambda s: s.replace("- cores: 2", "- cores: two"), "cores is not a count"),
    (lambda s: s.replace("2026-12-02", "December"), "date is not"),
    (lambda s: s.replace("bench cp", "bench ep"), "not this suite's"),
    (lambda s: s.split("\n\n")[1], "no header block"),
    (lambda s: s.split("\n\n")[0], "no table and not marked"),
])
def test_a_bad_section_is_found(edit, problem):
    assert section_problems("bench cp", GOOD) == []
    assert any(problem in p for p in section_problems("bench cp", edit(GOOD)))
