"""The README's Python examples run as written: the 30-second example (with its backend-object snippet) and each
transformers `generate()` idiom on a tiny model, whose tokens must equal eager `generate()`'s."""
import re

import pytest
import torch

from tests.docs.markdown import README, code_blocks, sections

EXAMPLE = "30-second example"
GENERATE = "transformers `generate()`"


def _blocks(title: str) -> list[str]:
    return code_blocks(sections(README.read_text())[title], "python")


def test_every_python_block_of_the_readme_is_run_here():
    every = code_blocks(README.read_text(), "python")
    assert len(_blocks(EXAMPLE)) == 2 and len(_blocks(GENERATE)) == 3
    assert every == _blocks(EXAMPLE) + _blocks(GENERATE), "a README Python block outside the sections this file runs"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compile cache for the module: the idioms compile the same graphs, so later ones are served from it."""
    return str(tmp_path_factory.mktemp("cache"))


def test_the_thirty_second_example_runs(tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("ASCEND_DSA_CACHE_DIR", cache_dir)
    dump = tmp_path / "dump"
    namespace: dict = {}
    for block in _blocks(EXAMPLE):
        assert "/tmp/ascend_dsa_dump" in block or "get_backend" in block
        exec(compile(block.replace("/tmp/ascend_dsa_dump", str(dump)), "README.md", "exec"), namespace)
    with torch.no_grad():
        x = torch.randn(8, 64)
        torch.testing.assert_close(namespace["compiled"](x), namespace["model"](x))  # the backend-object form
    assert list(dump.rglob("summary.json")) and list(dump.rglob("compiled.py"))


@pytest.mark.parametrize("idiom", [1, 2, 3])
def test_a_generate_idiom_gives_eager_tokens(idiom, tiny_transformers, monkeypatch, cache_dir):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("ASCEND_DSA_CACHE_DIR", cache_dir)
    block = _blocks(GENERATE)[idiom - 1]
    assert re.search(rf"# {idiom}\. ", block)
    model = tiny_transformers("llama")
    input_ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(idiom))
    expected = model.generate(input_ids, max_new_tokens=32, do_sample=False)
    namespace = {"torch": torch, "transformers": transformers, "model": model, "input_ids": input_ids}
    exec(compile(block, "README.md", "exec"), namespace)
    assert torch.equal(namespace["out"], expected)


DEMO = 'pip install torch==2.13.0 && pip install -e . && ascend-dsa demo'
TESTS = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'


def test_the_readme_is_an_entrance_with_its_two_commands_first():
    lines = README.read_text().split("\n")
    assert len(lines) <= 300
    assert DEMO in lines[:60] and TESTS in lines[:60]


def test_ci_runs_exactly_the_readmes_test_command():
    ci = (README.parent / ".ci" / "run").read_text().strip().split("\n")
    assert ci[-1] == TESTS
