"""npu_graph.startup.check_torch: the tested torch range is enforced at import with a clear message."""
import subprocess
import sys

import pytest

from npu_graph import startup as requirements


def test_tested_versions_pass(monkeypatch):
    monkeypatch.delenv(requirements.ENV_ALLOW, raising=False)
    for version in ("2.13.0", "2.13.1+cpu", "2.13.0a0+git1234"):
        requirements.check_torch(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.14.0", "3.0.0", "nightly"])
def test_other_versions_are_refused_naming_both_and_the_way_out(monkeypatch, version):
    monkeypatch.delenv(requirements.ENV_ALLOW, raising=False)
    with pytest.raises(ImportError, match=rf"tested with torch 2\.13\.x, but torch {version} is installed"
                                          rf".*pip install torch==2\.13\.0.*{requirements.ENV_ALLOW}=1"):
        requirements.check_torch(version)


def test_the_check_can_be_overridden(monkeypatch):
    monkeypatch.setenv(requirements.ENV_ALLOW, "1")
    requirements.check_torch("2.6.0")


def test_installed_metadata_declares_the_tested_range():
    from importlib import metadata

    requires = metadata.requires("ascend-dsa") or []
    torch_req = [r for r in requires if r.startswith("torch") and "extra" not in r]
    assert torch_req and "2.13" in torch_req[0] and "<2.14" in torch_req[0], requires
    assert any(r.startswith("numpy") for r in requires), "torch warns 'Failed to initialize NumPy' without it"


def test_import_refuses_an_untested_torch_without_importing_it():
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda name: '2.6.0' if name == 'torch' else real(name)\n"
            "try:\n    import npu_graph\nexcept ImportError as e:\n    print('refused:', e)\n"
            "import sys; print('torch imported:', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert "refused: ascend-dsa is tested with torch 2.13.x, but torch 2.6.0" in done.stdout, done.stderr
    assert "torch imported: False" in done.stdout
