"""Fusion that does not depend on how the model is written: for every fusion family, hypothesis composes spellings
from independent choices (npu_graph.tools.fusion_spellings), each is compiled static and with dynamic=True, and
must give the family's fused ops and eager's numbers; spellings of other math must not fuse, and their near miss
says why and shows the canonical expression it read. `-m slow` draws many more spellings."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npu_graph.tools.fusion_check import compile_spelling
from npu_graph.tools.fusion_spellings import FAMILY_MODULES, Family, family

DEFAULT_SPELLINGS = 12
SLOW_SPELLINGS = 80


def spellings(fam: Family) -> st.SearchStrategy:
    """One choice per independent axis of the family, settled (choices a path does not read fixed)."""
    return st.fixed_dictionaries({name: st.sampled_from(options) for name, options in fam.choices.items()}
                                 ).map(fam.settle)


def check_family(name: str, count: int) -> set:
    fam = family(name)
    seen: set = set()

    @settings(max_examples=count * 3, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(spellings(fam))
    def compile_each(choice):
        key = tuple(choice.items())
        if key in seen or len(seen) >= count:
            return
        seen.add(key)
        for dynamic in (False, True):
            outcome = compile_spelling(fam.build(choice), dynamic)
            assert outcome.fused and outcome.exact, f"{choice} dynamic={dynamic}: {outcome.detail}"

    compile_each()
    return seen


@pytest.mark.parametrize("name", FAMILY_MODULES)
def test_drawn_spellings_fuse_and_match_eager(name):
    assert len(check_family(name, DEFAULT_SPELLINGS)) == DEFAULT_SPELLINGS


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_MODULES)
def test_many_drawn_spellings_fuse_and_match_eager(name):
    assert len(check_family(name, SLOW_SPELLINGS)) >= min(SLOW_SPELLINGS, len(family(name).spellings()))


@pytest.mark.parametrize(("name", "negative"), [(m, n.name) for m in FAMILY_MODULES for n in family(m).negatives])
def test_other_math_does_not_fuse_and_the_near_miss_says_why(name, negative):
    found = next(n for n in family(name).negatives if n.name == negative)
    outcome = compile_spelling(found.build(), dynamic=False)
    assert outcome.fused and outcome.exact, outcome.detail     # fused == the op is absent, as the spelling says
    saying = [m for m in outcome.near_misses if found.reason in m["reason"] + " " + (m.get("differs") or "")]
    assert saying, outcome.near_misses
    assert all(m.get("canonical") for m in saying), saying     # the canonical expression the pass read
