"""Whole answers near the vector bound (docs/algorithm.md, 'Whole answers near the vector bound'):
the value map (:mod:`.values`), the split of the heads' output subspaces (:mod:`.split`), every
head's scores (:mod:`.scores`), the factored layer and its Jacobian (:mod:`.factored`), the
refinement (:mod:`.refine`) and the run (:mod:`.learn`)."""

from .learn import VectorExtraction, extract_vector, vector_bound
from .values import SplitUnavailable

__all__ = ["SplitUnavailable", "VectorExtraction", "extract_vector", "vector_bound"]
