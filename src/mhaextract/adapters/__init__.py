"""Adapters that turn real layers into oracles (optional extras).

:mod:`mhaextract.adapters.torch` (extra ``mhaextract[torch]``): ``torch.nn.MultiheadAttention`` and
Hugging Face GPT-2 attention as oracles, their ground-truth reduction and the way back to torch.
:mod:`mhaextract.adapters.rotary` (the same extra, with ``transformers``): Hugging Face Llama, Mistral
and Qwen2 rotary attention as modules of hidden states (oracles through ``TorchOracle``), their exact
float64 rotary model, and rotary models back as torch layers and into their classes.
:mod:`mhaextract.adapters.export`: ``to_torch`` and ``to_state_dict`` for every model type (the
registry of each family's adapter, :mod:`mhaextract.adapters.attention` and
:mod:`mhaextract.adapters.rotary`), and what an export may round.
"""
