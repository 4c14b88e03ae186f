"""Shared test fixtures: a clean Dynamo state per test, and a temporary dump folder."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_cache_options(tmp_path):
    return {"cache": False, "dump_dir": str(tmp_path / "dump")}
