"""Graph passes, one per module. Each exposes `run(gm, ctx) -> PassResult`; the order lives in
npu_graph.pipeline. The helpers they share live in the sub-packages matching/ and streams/."""
