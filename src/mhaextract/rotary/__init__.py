"""Rotary attention (docs/algorithm.md §22): the model, its queries and its extraction."""
