"""Whole answers near the vector bound (docs/algorithm.md, 'Whole answers near the vector bound'):
the value map and the split of the heads' output subspaces (:mod:`mhaextract.split`), every
head's scores (:mod:`.scores`), the factored layer and its Jacobian (:mod:`.factored`), the
refinement (:mod:`.refine`) and the run (:mod:`.learn`)."""

from .learn import VectorExtraction, extract_vector, vector_bound
from ..split.values import SplitUnavailable

__all__ = ["SplitUnavailable", "VectorExtraction", "extract_vector", "vector_bound"]
