"""The vocabulary the fusion passes match with: node values and op sets (values), axis tracing (axis_trace,
materialize), masks and attention parts, and the match-and-rewrite loop (fusion_graph, meta_refresh)."""
