"""Numerical kernels behind one arithmetic interface (:mod:`.arithmetic`).

Rational interpolation of one instance, poles and residues (docs/algorithm.md §6 in float64,
:mod:`.float64`; §7 in ball arithmetic, :mod:`.arb`; shared pieces in :mod:`.rational`), the
single-pole fits of the targeted schedule (§13, :mod:`.single_pole`), the assembly of redundant
measurements (§9, :mod:`.assembly`) and the mpmath/flint plumbing (:mod:`.highprec`).
"""
