"""Dim normalisation shared by the op families (PyTorch's maybe_wrap_dim).

PyTorch treats a 0-d tensor as having one dim for `dim=` arguments (0 and -1
are valid and mean "the whole tensor"); JAX rejects any axis on a 0-d array.
"""
from __future__ import annotations


def axis(x, dim):
    """The JAX axis for PyTorch's `dim` on array x: wrapped into range; None on a 0-d array."""
    if x.ndim == 0:
        if dim not in (0, -1):
            raise IndexError(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
        return None
    return dim % x.ndim
