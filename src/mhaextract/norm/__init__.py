"""Attention behind a norm, with the residual: a pre-norm block's sublayer (GPT-2, ViT), or attention and the
residual behind a norm: a post-norm block's (BERT) (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block')."""
