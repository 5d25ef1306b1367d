"""Baselines that mhaextract is measured against (``mhaextract bench``).

* :func:`extract_single_head`: the prior single-head algorithm (arXiv 2601.16873), ``d^2 + d``
  queries, and its multi-head use for heads in known pairwise orthogonal subspaces;
* :func:`distill`: gradient distillation of a student attention layer in PyTorch.
"""

from .distillation import distill
from .single_head import extract_single_head

__all__ = ["distill", "extract_single_head"]
