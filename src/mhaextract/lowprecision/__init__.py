"""Layers that answer in bfloat16 or float16 (docs/algorithm.md §23): a start from saturated
two-token queries (:mod:`.start`), least squares on whole answers to the answers' noise (:mod:`.fit`),
and the run (:mod:`.learn`)."""
