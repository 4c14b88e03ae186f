"""What runs a compiled CPU graph: the CompiledGraph the backend hands back (compiled_graph), the binders of
its generated source (direct_calls), the parameter prologue (hoist), SuperKernel regions (superkernel) and
their measured choices (autotune), host streams and events (streams), single-threaded small ATen calls
(serial_calls) and profiler events for fused ops (profiling)."""
