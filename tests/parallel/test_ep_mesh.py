"""EP composed with DP×CP×TP (`init_parallel(dp, cp, tp, ep_dims)`): argument errors without processes and,
slow-marked, the reference MoE block sharded over each EP layout compiled with ascend_dsa on 4 gloo ranks and
the 3-D (2, 2, 2) mesh on 8 (EP over all three dimensions, and over dp×cp with the TP split). The eager 4-rank
layouts run in test_ep_dispatch.py's spawn."""
import ep_mesh_workers
import pytest

from npu_graph.parallel import init_parallel, launch


def test_errors_without_processes():
    with pytest.raises(ValueError, match=r"ep_dims=\('cp', 'cp'\) must name distinct dimensions"):
        init_parallel(cp=2, ep_dims=("cp", "cp"))
    with pytest.raises(ValueError, match="dp, cp and tp must be >= 1"):
        init_parallel(tp=0)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        init_parallel(cp=2, tp=2, ep_dims=("cp",))


@pytest.mark.slow
def test_compiled_layouts_on_4_ranks():
    ranks = launch(ep_mesh_workers.mesh_checks, 4, args=(ep_mesh_workers.LAYOUTS_4, True), timeout_s=600.0)
    for layout in ep_mesh_workers.LAYOUTS_4:
        ep_mesh_workers.check_layout(ranks, layout, ("compiled", layout))


@pytest.mark.slow
def test_3d_mesh_on_8_ranks():
    ranks = launch(ep_mesh_workers.mesh_checks, 8, args=(ep_mesh_workers.LAYOUTS_8,), timeout_s=600.0)
    for layout in ep_mesh_workers.LAYOUTS_8:
        ep_mesh_workers.check_layout(ranks, layout)
