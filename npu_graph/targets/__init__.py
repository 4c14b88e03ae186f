"""Lowering of a finished graph for a device: cpu (default) and npu."""
