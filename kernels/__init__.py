"""Fused operators `torch.ops.ascend_dsa.*`: schema, fake function, reference and fast CPU implementation.

Importing this package registers every op. Each op lives in its own module; the list below is literal.
"""
