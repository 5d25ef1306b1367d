"""Numerical kernels behind one arithmetic interface (:mod:`.arithmetic`).

Rational interpolation of one instance, poles and residues (docs/algorithm.md, 'Kernels in float64',
:mod:`.float64`; 'Kernels in ball arithmetic and certification', :mod:`.arb`; shared pieces in :mod:`.rational`), the
single-pole fits of the targeted schedule ('The targeted schedule', :mod:`.single_pole`), the assembly of redundant
measurements ('Assembly', :mod:`.assembly`) and the mpmath/flint plumbing (:mod:`.highprec`).
"""
