"""Adapters that turn real layers into oracles (optional extras).

:mod:`mhaextract.adapters.torch` (extra ``mhaextract[torch]``): ``torch.nn.MultiheadAttention`` and
Hugging Face GPT-2 attention as oracles, their ground-truth reduction and the way back to torch.
"""
