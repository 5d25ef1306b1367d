"""Rotary attention (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'): the model,
its queries and its extraction."""
