"""The canonical form the fusion passes match (docs/DESIGN.md, "The canonical form").

Graph rules (rules_*.py, applied by the canonical_form pass before any fusion pass): one ATen op for each
elementwise function however it was spelled, the commutative operands of add and mul in one order
(structure.py), halves and even/odd pairs of the last dim as slices, complex rotations as real pairs, top-k with
one set of flags, value-preserving casts removed. Terms (terms.py, over passes/matching/axis_trace.py): every
contraction as one Σ over named axes of a product of factors with its constant and symbolic scalar scale; masks
(masks.py) as one form. printer.py writes a canonical term as text for near misses.
"""
