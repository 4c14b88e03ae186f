"""The on-disk compile cache: keys, hits that skip compilation, private entries, guards, damaged entries, LRU,
concurrency. (Tampering: test_cache_trust.py; damaged and read-only caches: test_cache_damage.py.)"""
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from cache_helpers import MODEL, compile_once, isolated_key

import npu_graph
from npu_graph import backend as backend_module
from npu_graph.cache import key as cache_key
from npu_graph.cache.disk_store import CacheWarning, DiskCache

own_key = isolated_key()


def key_of(gm_fn, *args, config=None):
    captured = {}

    def grab(gm, example_inputs, **kw):
        captured["key"] = cache_key.cache_key(cache_key.key_material(
            gm, example_inputs, config or npu_graph.CompilerConfig(), inference=True))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(gm_fn, backend=grab)(*args)
    return captured["key"]


def test_miss_then_hit_skips_capture(tmp_path, monkeypatch):
    first, out1 = compile_once(tmp_path)
    assert first.cache == "miss"

    def no_capture(*a, **k):
        raise AssertionError("a cache hit must not capture or compile")

    monkeypatch.setattr(backend_module, "capture_and_compile", no_capture)
    second, out2 = compile_once(tmp_path)
    assert second.cache == "hit" and torch.equal(out1, out2)
    stats = DiskCache(str(tmp_path)).stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["entries"] == 1


def test_entry_files_are_private_and_not_pickles(tmp_path):
    compile_once(tmp_path)
    disk = DiskCache(str(tmp_path))
    (key,) = disk.entry_keys()
    folder = disk.entry_dir(key)
    assert sorted(os.listdir(folder)) == ["compiled.py", "constants.safetensors", "meta.json", "tag"]
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    assert all(oct(os.stat(os.path.join(folder, f)).st_mode & 0o777) == "0o600" for f in os.listdir(folder))
    assert not os.listdir(os.path.join(disk.base, "tmp"))


def test_key_is_stable_across_processes_and_hash_seeds():
    code = MODEL + textwrap.dedent("""
        import npu_graph
        from npu_graph.cache import key as cache_key
        out = {}
        def grab(gm, ex, **kw):
            out["k"] = cache_key.cache_key(cache_key.key_material(gm, ex, npu_graph.CompilerConfig(), True))
            return gm.forward
        torch.manual_seed(0)
        with torch.no_grad():
            torch.compile(Net(), backend=grab)(torch.randn(4, 16))
        print(out["k"])
    """)
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert len(keys) == 1 and len(keys.pop()) == 64


def test_key_changes_with_each_input(monkeypatch):
    monkeypatch.delenv("ASCEND_DSA_CPU_GLUE", raising=False)   # the suite's default (conftest): configs below differ
    x = torch.randn(4, 16)
    torch.manual_seed(0)
    base = key_of(lambda x: (x * 2).softmax(-1), x)
    assert key_of(lambda x: (x * 2).softmax(-1), x) == base
    assert key_of(lambda x: (x * 3).softmax(-1), x) != base
    assert key_of(lambda x: (x * 2).softmax(0), x) != base
    assert key_of(lambda x: (x * 2).softmax(-1), x.double()) != base
    config = npu_graph.CompilerConfig.from_options
    assert key_of(lambda x: (x * 2).softmax(-1), x, config=config({"quant": "dsa"})) != base
    assert key_of(lambda x: (x * 2).softmax(-1), x, config=config({"verify": True})) == base
    assert key_of(lambda x: (x * 2).softmax(-1), x, config=config({"cpu.glue": "python"})) != base
    monkeypatch.setattr(cache_key, "pipeline_uuids", lambda: {"canonicalize": "edited"})
    assert key_of(lambda x: (x * 2).softmax(-1), x) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache_key, "source_digest", lambda: "a helper or kernel was edited")
    assert key_of(lambda x: (x * 2).softmax(-1), x) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache_key, "versions", lambda: {"torch": "9.9"})
    assert key_of(lambda x: (x * 2).softmax(-1), x) != base


def test_source_digest_follows_every_source_file_wherever_installed(tmp_path):
    def package(where):
        for name, text in {"npu_graph/a.py": "x = 1", "npu_graph/targets/b.py": "", "kernels/native/k.c": "int k;",
                           "kernels/k.h": ""}.items():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_text(text)
        return {"npu_graph": where / "npu_graph", "npu_graph.kernels": where / "kernels"}

    roots = package(tmp_path / "one")
    base = cache_key.source_digest_of(roots)
    assert cache_key.source_digest_of(package(tmp_path / "two")) == base
    for unrelated in ("npu_graph/__pycache__/a.cpython.pyc", "npu_graph/tools/cli.py", "npu_graph/notes.txt"):
        (tmp_path / "one" / unrelated).parent.mkdir(exist_ok=True)
        (tmp_path / "one" / unrelated).write_text("changed")
    assert cache_key.source_digest_of(roots) == base
    for edited in ("npu_graph/targets/b.py", "kernels/native/k.c", "kernels/k.h"):
        path = tmp_path / "one" / edited
        original = path.read_text()
        path.write_text(original + "# edited")
        assert cache_key.source_digest_of(roots) != base, edited
        path.write_text(original)


def test_source_digest_covers_the_helpers_lowering_runtime_and_kernels_of_the_real_package(monkeypatch):
    names = {name for name, _ in cache_key.source_files(cache_key.package_roots())}
    for helper in ("npu_graph.passes/matching/axis_trace.py", "npu_graph.passes/matching/match_util.py",
                   "npu_graph/runtime/hoist.py", "npu_graph/runtime/compiled_graph.py", "npu_graph/targets/cpu.py",
                   "npu_graph.kernels/rowwise/rms_norm.py", "npu_graph.kernels/native/rms_norm.c"):
        assert helper in names, helper
    assert not any(name.startswith("npu_graph/tools/") or "__pycache__" in name for name in names)
    base = cache_key.source_digest_of(cache_key.package_roots())
    edited = next(path for name, path in cache_key.source_files(cache_key.package_roots())
                  if name == "npu_graph.passes/matching/axis_trace.py")
    real_read = type(edited).read_bytes
    monkeypatch.setattr(type(edited), "read_bytes",
                        lambda self: real_read(self) + (b"# edited" if self == edited else b""))
    assert cache_key.source_digest_of(cache_key.package_roots()) != base


def test_damaged_entries_are_quarantined_and_recompiled(tmp_path):
    compile_once(tmp_path)
    disk = DiskCache(str(tmp_path))
    (key,) = disk.entry_keys()
    with open(os.path.join(disk.entry_dir(key), "compiled.py"), "a") as f:
        f.write("\n# edited\n")
    with pytest.warns(CacheWarning, match="quarantine"):
        report, _ = compile_once(tmp_path)
    assert report.cache == "miss" and os.listdir(os.path.join(disk.base, "quarantine"))
    (key,) = disk.entry_keys()
    with open(os.path.join(disk.entry_dir(key), "meta.json"), "r+") as f:
        f.truncate(20)
    with pytest.warns(CacheWarning):
        report, _ = compile_once(tmp_path)
    assert report.cache == "miss"


def test_guards_on_symbolic_sizes_are_checked(tmp_path, monkeypatch):
    from npu_graph import pipeline

    def guarding_pass(gm, ctx):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() == 2 and val.shape[1] == 16:
                bool(val.shape[0] > 4)
        return pipeline.PassResult(changed=False)

    fake_pass = types.SimpleNamespace(NAME="guarding", INFERENCE_ONLY=False, run=guarding_pass)
    monkeypatch.setattr(pipeline, "PASSES", [*pipeline.PASSES, fake_pass])
    monkeypatch.setattr(pipeline, "pass_uuid", lambda p: "fixed")

    def run(rows):
        x = torch.randn(rows, 16)
        torch._dynamo.mark_dynamic(x, 0)
        return compile_once(tmp_path, x=x)[0]

    first = run(8)
    assert first.cache == "miss", first.cache_reason
    second = run(9)
    assert second.cache == "hit", second.cache_reason
    low = run(3)
    assert low.cache == "miss" and "guards" in low.cache_reason


def test_lru_prune_keeps_recently_used(tmp_path):
    for scale in (1.0, 2.0, 3.0):
        compile_once(tmp_path, model=torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Softmax(-1)),
                     x=torch.randn(4, 16) * scale if scale != 3.0 else torch.randn(5, 16))
    disk = DiskCache(str(tmp_path))
    entries = disk.entries_by_recency()
    assert len(entries) >= 2
    oldest = entries[0]["key"]
    os.utime(os.path.join(disk.entry_dir(oldest), "meta.json"))
    keep = sum(e["size"] for e in entries if e["key"] == oldest) + 1
    result = disk.prune(max_size=keep)
    assert oldest not in result["removed"] and not result["left"] and disk.entry_keys() == [oldest]


def test_prune_older_than(tmp_path):
    compile_once(tmp_path)
    disk = DiskCache(str(tmp_path))
    (key,) = disk.entry_keys()
    os.utime(os.path.join(disk.entry_dir(key), "meta.json"), (1, 1))
    assert disk.prune(older_than=3600) == {"removed": [key], "left": {}} and disk.entry_keys() == []


CONCURRENT = MODEL + textwrap.dedent("""
    import sys, npu_graph
    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():
        out = torch.compile(m, backend="ascend_dsa", options={"cache_dir": sys.argv[1]})(torch.ones(4, 16))
    print(float(out.double().sum()))
""")


@pytest.mark.parametrize("processes", [pytest.param(3), pytest.param(8, marks=pytest.mark.slow)])
def test_concurrent_processes_share_one_entry(tmp_path, processes):
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]
    assert len({r[0].strip() for r in results}) == 1
    disk = DiskCache(str(tmp_path))
    assert len(disk.entry_keys()) == 1 and not os.listdir(os.path.join(disk.base, "tmp"))
    stats = disk.stats()
    assert stats["misses"] == 1 and stats["hits"] == processes - 1
