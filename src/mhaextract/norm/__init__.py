"""Attention behind a norm, with the residual: a pre-norm block's sublayer (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block')."""
