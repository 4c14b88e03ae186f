"""Inductor's C++ kernels of one glue module built together (npu_graph.runtime.batched_kernels): the joined
translation unit, the groups, real builds whose functions compute what each kernel says, the one-by-one path
when a joined build cannot be made or fails, a kernel used before `wait`, and Inductor's class put back after a
compile. The glue module itself, compiled from a graph, is checked in test_inductor_glue.py."""
import pytest
import torch
from torch._inductor import async_compile as inductor_async

from npu_graph.runtime import batched_kernels
from npu_graph.runtime.batched_kernels import BatchedKernels, Pending

PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>\n"
ADD = PREFIX + """extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)
{
    for (int64_t i = 0; i < ks0; i++) out_ptr0[i] = in_ptr0[i] + 1.0f;
}
"""
SCALE = PREFIX + """extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0, const float s)
{
    for (int64_t i = 0; i < ks0; i++) out_ptr0[i] = in_ptr0[i] * s;
}
"""
ARGS_ADD = ["const float*", "float*", "const int64_t"]
ARGS_SCALE = ["const float*", "float*", "const int64_t", "const float"]


def _kernels(count: int) -> list[Pending]:
    return [Pending(i, tuple(ARGS_ADD), ADD.replace("1.0f", f"{i}.0f")) for i in range(count)]


def test_library_source_joins_kernels_under_their_names_with_one_include():
    source = batched_kernels.library_source(_kernels(3))
    assert source.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    for i in range(3):
        assert f"void kernel_{i}(" in source and f'{{"kernel_{i}", kernel_{i}_py' in source
    assert "void  kernel(" not in source and "PyInit_kernels" in source


def test_sources_without_a_kernel_definition_or_with_unknown_arguments_are_refused():
    with pytest.raises(ValueError, match="no `void kernel\\(` definition"):
        batched_kernels.library_source([Pending(0, (), PREFIX + "int helper() { return 1; }\n")])
    with pytest.raises(ValueError, match="has no conversion"):
        batched_kernels.library_source([Pending(0, ("std::string",), ADD)])


@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_groups_balance_sizes_keep_order_and_are_never_empty(count):
    kernels = _kernels(5)
    kernels[2].source += "// padding\n" * 200
    groups = batched_kernels.groups(kernels, count)
    assert len(groups) == min(count, 5) and all(groups)
    assert sorted(k.name for g in groups for k in g) == sorted(k.name for k in kernels)
    for group in groups:
        assert [k.name for k in group] == sorted((k.name for k in group), key=lambda n: int(n.split("_")[1]))
    if count >= 2:
        assert any(g == [kernels[2]] for g in groups)   # the largest kernel alone


def _run_two_kernels(compiler: BatchedKernels) -> dict:
    scope = {"cpp_add": compiler.cpp_pybinding(ARGS_ADD, ADD), "cpp_scale": compiler.cpp_pybinding(ARGS_SCALE, SCALE),
             "other": 3}
    compiler.wait(scope)
    return scope


def test_built_kernels_replace_their_placeholders_and_compute():
    scope = _run_two_kernels(BatchedKernels())
    x, out = torch.arange(6, dtype=torch.float32), torch.empty(6)
    scope["cpp_add"](x, out, 6)
    torch.testing.assert_close(out, x + 1)
    scope["cpp_scale"](x, out, 4, 2.5)
    torch.testing.assert_close(out[:4], x[:4] * 2.5)
    assert scope["other"] == 3
    with pytest.raises(TypeError, match="takes 3 arguments"):
        scope["cpp_add"](x, out)


def test_a_join_that_cannot_be_made_or_fails_builds_kernels_one_by_one(monkeypatch):
    def refuse(kernels):
        raise ValueError("refused")
    monkeypatch.setattr(batched_kernels, "library_source", refuse)
    scope = _run_two_kernels(BatchedKernels())
    x, out = torch.ones(3), torch.empty(3)
    scope["cpp_add"](x, out, 3)
    torch.testing.assert_close(out, x + 1)

    monkeypatch.undo()

    def failing_load(*args, **kwargs):
        def load():
            raise RuntimeError("compiler error")
        return load
    monkeypatch.setattr(batched_kernels._Library, "load_async", staticmethod(failing_load))
    scope = _run_two_kernels(BatchedKernels())
    scope["cpp_scale"](x, out, 3, 3.0)
    torch.testing.assert_close(out, x * 3)


def test_a_kernel_called_before_wait_names_the_missing_wait():
    pending = BatchedKernels().cpp_pybinding(ARGS_ADD, ADD)
    with pytest.raises(RuntimeError, match=r"did not call async_compile.wait\(globals\(\)\)"):
        pending(torch.ones(1), torch.empty(1), 1)


def test_building_batched_swaps_inductors_class_and_puts_it_back():
    original = inductor_async.AsyncCompile
    with pytest.raises(KeyError), batched_kernels.building_batched():
        assert inductor_async.AsyncCompile is BatchedKernels
        raise KeyError("inside")
    assert inductor_async.AsyncCompile is original


def test_glue_sources_create_batched_kernels_where_inductor_creates_its_own():
    from npu_graph.runtime import inductor_glue
    source = "from torch._inductor.async_compile import AsyncCompile\nasync_compile = AsyncCompile()\nk = 1\n"
    rewritten = inductor_glue._with_batched_kernels(source)
    assert "\nasync_compile = BatchedKernels()\n" in rewritten and "AsyncCompile()" not in rewritten
    other = "async_compile = SomethingElse()\n"
    assert inductor_glue._with_batched_kernels(other) == other
