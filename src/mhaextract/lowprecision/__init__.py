"""Layers that answer in bfloat16 or float16 (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then
least squares'): a start from saturated two-token queries (:mod:`.start`), least squares on whole answers to the
answers' noise (:mod:`.fit`), and the run (:mod:`.learn`)."""
