"""Numerical kernels: rational interpolation of one instance, poles and residues, assembly.

Two paths with the same functions: :mod:`.float64` (numpy, batched over instances) and
:mod:`.arb` (python-flint ball arithmetic, certified). :mod:`.rational` holds what they share.
"""
