"""Torch modules as oracles (any of them), the ground truth of known attention layers, and the export back.

:class:`TorchOracle` is black-box: any ``nn.Module`` (or callable on tensors) mapping tokens
(B, N, d) to outputs (B, N, d_out) (a tuple's first element is taken; ``nn.MultiheadAttention``
is called as self-attention), answering its whole output at the last position (B, d_out), or
``r^T`` of it for a read-out ``r``. It runs the module in its own dtype and on its own device and
knows nothing of the layer's class.

Layer-specific code lives only in :func:`to_reduced` (the ground truth, from the weights) and
:mod:`mhaextract.adapters.attention` (export into the layer's own class). A layer with H heads of width r has per
head ``r x d`` query, key and value blocks ``Wq_h, Wk_h, Wv_h``, a ``d_out x r`` output block
``Wo_h`` (the identity's block for BERT's self-attention, which has none), biases
``b_Q, b_K, b_V, b_O`` and a score scale sigma (``1/sqrt(r)`` by default). It is the model of
docs/algorithm.md, 'Biases: affine scores and an output constant' and 'The whole layer: vector outputs and a replacement
module' with

    W_h = sigma Wk_h^T Wq_h,   u_h = sigma Wk_h^T b_Q_h,   V_h = Wo_h Wv_h,
    c   = sum_h Wo_h b_V_h + b_O,

and read out through r, ``v_h = V_h^T r`` and ``r^T c``; ``b_K`` adds the same score to every token
of a row and cancels in the softmax. Supported: ``nn.MultiheadAttention``, transformers'
``GPT2Attention``, ``BertSelfAttention``, ``OPTAttention`` and ``ViTAttention`` (eager or sdpa).
Settings outside the model class are refused by :func:`to_reduced` with the reason:
``add_bias_kv``, ``add_zero_attn``, ``kdim``/``vdim`` other than ``embed_dim``, cross-attention,
rotary or relative position embeddings. Extraction against such a layer fails its checks rather
than returning heads (the oracle cannot know to refuse it).

:func:`to_torch` (:mod:`mhaextract.adapters.export`, for every model type) turns an extracted model
back into a module: the final-token function f (:class:`ReducedAttention`), or a whole attention
layer (B, N, d) -> (B, N, d_out) (:class:`ExtractedAttention`) whose heads are factored at their
width, ``W_h = K_h^T Q_h`` and ``V_h = O_h P_h``, causal or not as the run's causal record found.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("mhaextract.adapters.torch needs PyTorch: pip install 'mhaextract[torch]'") from error

from ..models.attention import MultiHeadAttention, as_batch
from ..oracle.queries import rows_of
from ..oracle.vector_answers import read_out
from .export import (  # noqa: F401 - the public names of the way back, importable from here as before
    CLASS_REMEDY, RANK_GAP, CausalityWarning, ExportReport, RoundedExportWarning, UnsupportedLayerError,
    factor_at_width, numerical_rank, to_state_dict, to_torch,
)


@dataclass
class _Blocks:
    """One layer's per-head blocks in float64: Wq, Wk, Wv (H, r, d), Wo (H, d, r), biases
    bq, bv (H, r) and bo (d,), the score scale sigma."""

    kind: str
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wo: np.ndarray
    bq: np.ndarray
    bv: np.ndarray
    bo: np.ndarray
    sigma: float


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def _bias(linear, shape) -> np.ndarray:
    return _numpy(linear.bias).reshape(shape) if getattr(linear, "bias", None) is not None else np.zeros(shape)


def _linear_blocks(kind, q, k, v, o, H: int, sigma: float) -> _Blocks:
    """Blocks of a layer with separate ``nn.Linear`` projections (``o`` None: no output projection)."""
    d = q.weight.shape[1]
    r = q.weight.shape[0] // H
    Wq, Wk, Wv = (_numpy(layer.weight).reshape(H, r, d) for layer in (q, k, v))
    if o is None:
        Wo, bo = np.eye(H * r).reshape(H * r, H, r).transpose(1, 0, 2), np.zeros(H * r)
    else:
        Wo, bo = _numpy(o.weight).reshape(-1, H, r).transpose(1, 0, 2), _bias(o, o.weight.shape[0])
    return _Blocks(kind, Wq, Wk, Wv, Wo, _bias(q, (H, r)), _bias(v, (H, r)), bo, float(sigma))


def _refuse_positions(kind: str, module) -> None:
    config = getattr(module, "config", None)
    position = getattr(config, "position_embedding_type", "absolute") if config is not None else "absolute"
    if position not in (None, "absolute") or hasattr(module, "rotary_emb"):
        raise UnsupportedLayerError(f"{kind} with position embedding {position!r} (rotary or relative) adds "
                                    "position-dependent scores: not the model class (docs/algorithm.md, "
                                    "'Biases: affine scores and an output constant')")
    if getattr(module, "is_cross_attention", False):
        raise UnsupportedLayerError(f"{kind} with is_cross_attention=True attends to encoder states: "
                                    "not self-attention over the query sequence")


def _multihead_attention_blocks(module: nn.MultiheadAttention) -> _Blocks:
    if not module._qkv_same_embed_dim:
        raise UnsupportedLayerError(
            f"nn.MultiheadAttention with kdim={module.kdim}, vdim={module.vdim} != embed_dim={module.embed_dim}: "
            "keys and values of another dimension are cross-attention; the oracle feeds one sequence as "
            "query, key and value")
    if module.bias_k is not None or module.bias_v is not None:
        raise UnsupportedLayerError("nn.MultiheadAttention with add_bias_kv=True appends learned key/value tokens "
                                    "to every sequence: not the model the extractor learns")
    if module.add_zero_attn:
        raise UnsupportedLayerError("nn.MultiheadAttention with add_zero_attn=True appends a zero key/value token "
                                    "to every sequence: not the model the extractor learns")
    d, H = module.embed_dim, module.num_heads
    r = d // H
    Wq, Wk, Wv = _numpy(module.in_proj_weight).reshape(3, H, r, d)  # rows [q; k; v], heads along rows
    Wo = _numpy(module.out_proj.weight).reshape(d, H, r).transpose(1, 0, 2)  # columns split into heads
    if module.in_proj_bias is not None:
        bq, _, bv = _numpy(module.in_proj_bias).reshape(3, H, r)
    else:
        bq = bv = np.zeros((H, r))
    bo = _numpy(module.out_proj.bias) if module.out_proj.bias is not None else np.zeros(d)
    return _Blocks("nn.MultiheadAttention", Wq, Wk, Wv, Wo, bq, bv, bo, 1.0 / np.sqrt(r))


def _gpt2_blocks(module) -> _Blocks:
    _refuse_positions("GPT2Attention", module)
    config = module.config
    d, H = module.embed_dim, module.num_heads
    r = d // H
    # Conv1D computes x @ weight + bias: weight is (in, out), the transpose of nn.Linear's.
    Wq, Wk, Wv = _numpy(module.c_attn.weight).T.reshape(3, H, r, d)
    Wo = _numpy(module.c_proj.weight).T.reshape(d, H, r).transpose(1, 0, 2)
    bq, _, bv = _numpy(module.c_attn.bias).reshape(3, H, r)
    sigma = r ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        sigma /= float(module.layer_idx + 1)
    return _Blocks("GPT2Attention", Wq, Wk, Wv, Wo, bq, bv, _numpy(module.c_proj.bias), sigma)


def _blocks(module) -> _Blocks:
    """Split a supported layer into heads, refusing settings that change the model."""
    name = type(module).__name__
    if isinstance(module, nn.MultiheadAttention):
        return _multihead_attention_blocks(module)
    if name == "GPT2Attention" and hasattr(module, "c_attn"):
        return _gpt2_blocks(module)
    if name == "BertSelfAttention" and hasattr(module, "query"):
        _refuse_positions(name, module)
        return _linear_blocks(name, module.query, module.key, module.value, None, module.num_attention_heads,
                              getattr(module, "scaling", module.attention_head_size ** -0.5))
    if name in ("OPTAttention", "ViTAttention") and hasattr(module, "q_proj"):
        _refuse_positions(name, module)
        out = module.out_proj if hasattr(module, "out_proj") else module.o_proj
        H = getattr(module, "num_heads", None) or module.config.num_attention_heads
        return _linear_blocks(name, module.q_proj, module.k_proj, module.v_proj, out, H, module.scaling)
    raise TypeError(f"to_reduced knows torch.nn.MultiheadAttention or transformers' GPT2Attention, "
                    f"BertSelfAttention, OPTAttention and ViTAttention, not {name} (TorchOracle takes any module)")


def _readout(readout, d: int) -> np.ndarray:
    u = _numpy(readout) if isinstance(readout, torch.Tensor) else np.asarray(readout, dtype=np.float64)
    if u.shape != (d,):
        raise ValueError(f"readout must be a vector of length d = {d} (the layer's output width), got shape {u.shape}")
    if not np.isfinite(u).all():
        raise ValueError("readout must be finite")
    return u


def to_reduced(module, readout=None) -> MultiHeadAttention:
    """The ground truth ``(W_h, V_h, u_h)`` and ``c`` of a layer (module docstring), in float64, one head
    per head of the layer (not canonicalised): the vector model of its whole output, or with a
    ``readout`` r the scalar model ``(W_h, v_h = V_h^T r, u_h)``, ``r^T c``. White-box: for tests,
    benchmarks and diagnostics, never on the extraction path. Raises :class:`UnsupportedLayerError`
    for settings outside the model class, naming the setting; ``TypeError`` for other modules.

    Examples
    --------
    >>> import torch
    >>> from mhaextract.adapters.torch import to_reduced
    >>> layer = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> truth = to_reduced(layer)
    >>> truth.W.shape, truth.V.shape, truth.c.shape
    ((2, 8, 8), (2, 8, 8), (8,))
    """
    blocks = _blocks(module)
    W = blocks.sigma * np.einsum("hrd,hre->hde", blocks.Wk, blocks.Wq)  # sigma Wk_h^T Wq_h
    u = blocks.sigma * np.einsum("hrd,hr->hd", blocks.Wk, blocks.bq)  # sigma Wk_h^T b_Q_h
    V = np.einsum("hor,hrd->hod", blocks.Wo, blocks.Wv)  # Wo_h Wv_h
    c = np.einsum("hor,hr->o", blocks.Wo, blocks.bv) + blocks.bo
    if readout is None:
        return MultiHeadAttention(W, V, u, c)
    r = _readout(readout, blocks.Wo.shape[1])
    return MultiHeadAttention(W, np.einsum("hod,o->hd", V, r), u, float(r @ c))


def suggested_token_scale(module, readout=None) -> float:
    """A white-box token scale from the layer's weights (:meth:`MultiHeadAttention.suggested_token_scale`
    of :func:`to_reduced`): a diagnostic; extraction finds its scale from queries (``token_scale="auto"``).

    Examples
    --------
    >>> import torch
    >>> from mhaextract.adapters.torch import suggested_token_scale
    >>> bool(suggested_token_scale(torch.nn.MultiheadAttention(4, 2).double()) > 0)
    True
    """
    return to_reduced(module, readout).suggested_token_scale()


#: Sequences whose outputs at every position TorchOracle keeps for the causal record.
EVIDENCE_SEQUENCES = 8


def _floating_dtype(module) -> torch.dtype:
    for tensor in list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []:
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def _device(module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()) if isinstance(module, nn.Module) else []:
        return tensor.device
    return torch.device("cpu")


class TorchOracle:
    """Any torch module (or callable on tensors) as an oracle: its output at the last position.

    Parameters
    ----------
    module : ``nn.Module`` or callable mapping a float tensor (B, N, d) to (B, N, d_out) (or a tuple
        whose first element is that). ``nn.MultiheadAttention`` is called as self-attention
        ``module(X, X, X)`` (either ``batch_first``). An ``nn.Module`` is copied in eval mode; the
        caller's is not changed. Nothing about its class is used.
    readout : vector of length d_out (array or tensor), optional. None (default): the oracle answers
        the whole output at the last position, (B, d_out), and :func:`mhaextract.extract` learns the
        whole layer (``result.model.V``, ``result.model.c``). A vector r: it answers ``r^T`` of it, (B,),
        and the result is the scalar model of that read-out.

    Attributes
    ----------
    module : what answers (the eval-mode copy).
    readout : (d_out,) float64 array, or None (whole outputs).
    d_out : outputs per answer (None for a readout's scalar answers until the first call).
    dtype, device : the module's own (its first floating parameter's), in which it is run.
    answer_dtype : ``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``: the precision of the
        answers (reported as ``Extraction.answer_dtype``; a float32 layer cannot be extracted to
        float64 accuracy). Answers cross as float64, converted exactly.
    calls, sequences : forward passes run and sequences answered.
    position_evidence : the module's outputs at every position of a few answered sequences, which
        ``extract`` judges the layer's causality from (``result.causal``).

    Sequences of equal length are stacked into one forward pass, in the module's dtype, on its
    device. The targeted schedules' copies-instances cross as two rows a query, ``(x, z)`` (the
    boundary hands them as :class:`~mhaextract.oracle.queries.CopiesRows`), and are built there
    (``(y, .., y, x)``, ``y = x - z`` in float64): the same tokens and the same passes as their
    sequences stacked on the host, without writing every token on the host (docs/scale.md, "GPU
    oracles"). Tokens must be float arrays (a torch layer serves float64 extractions,
    ``precision=None``); the size of a pass is the extraction's ``batch_size``.

    Examples
    --------
    >>> import numpy as np, torch
    >>> from mhaextract.adapters.torch import TorchOracle
    >>> layer = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    >>> TorchOracle(layer)([np.ones((3, 8)), np.ones((5, 8))]).shape      # whole outputs
    (2, 8)
    >>> TorchOracle(layer, readout=np.ones(8))([np.ones((3, 8))]).shape   # one read-out
    (1,)
    """

    #: Handed copies-instances as their rows (:class:`~mhaextract.oracle.queries.CopiesRows`): it
    #: builds their sequences where the module runs.
    takes_copies_rows = True

    def __init__(self, module, readout=None):
        if not callable(module):
            raise TypeError(f"module must be a torch.nn.Module or a callable on tensors, got {type(module).__name__}")
        self.dtype, self.device = _floating_dtype(module), _device(module)
        self.module = copy.deepcopy(module).eval() if isinstance(module, nn.Module) else module
        self.readout = None
        if readout is not None:
            length = int(np.asarray(readout.detach().cpu() if isinstance(readout, torch.Tensor) else readout).size)
            self.readout = _readout(readout, length)
        self.d_out = None if self.readout is None else len(self.readout)
        self.answer_dtype = str(self.dtype).removeprefix("torch.")
        # The read-out is ours, not the layer's: the whole run's arithmetic (read_out), float32
        # numbers for a layer below float64, so that the precision shows in the answers' type.
        self._single = self.dtype != torch.float64
        self.calls = 0
        self.sequences = 0
        self._original = module
        self._evidence = collections.deque(maxlen=EVIDENCE_SEQUENCES)

    @property
    def reduced(self) -> MultiHeadAttention:
        """:func:`to_reduced` of the layer: white-box ground truth, for diagnostics only."""
        return to_reduced(self._original, self.readout)

    @property
    def suggested_token_scale(self) -> float:
        """White-box diagnostic (reads the weights): see :func:`suggested_token_scale`."""
        return self.reduced.suggested_token_scale()

    def __repr__(self) -> str:
        outputs = "whole outputs" if self.readout is None else f"read out, d_out={len(self.readout)}"
        return f"TorchOracle({type(self._original).__name__}, {self.answer_dtype}, {outputs})"

    def __call__(self, batch) -> np.ndarray:
        groups, count = self._copies_groups(batch) or self._length_groups(batch)
        out = None
        with torch.inference_mode():
            for index, build in groups:
                X = build()
                every = self._every_position(X)
                last = every[:, -1]
                if self.readout is not None and last.shape != (len(index), len(self.readout)):
                    raise ValueError(f"the module's output at the last position has shape {tuple(last.shape)}, "
                                     f"expected (B, {len(self.readout)}) for a readout of length {len(self.readout)}")
                if last.dim() != 2:
                    raise ValueError(f"the module's output at the last position has shape {tuple(last.shape)}; "
                                     "expected (B, d_out)")
                self._keep_evidence(X, every)
                answers = last.to(torch.float64).cpu().numpy()  # exact: every float dtype widens
                if self.readout is None:
                    self.d_out = answers.shape[1]
                else:
                    answers = read_out(answers, self.readout, self._single)
                if out is None:
                    out = np.empty((count,) + answers.shape[1:], dtype=np.float64)
                out[index] = answers
                self.calls += 1
        self.sequences += count
        if out is None:
            out = np.empty((0,) if self.readout is not None else (0, self.d_out or 0))
        if self.readout is not None and self._single:
            return out.astype(np.float32)  # float32 numbers: the answers' precision shows in their type
        return out

    def _length_groups(self, batch):
        """Any batch: the sequences of each length stacked into one forward pass, ``(groups, count)``;
        the tokens go to the module's device and are cast there, as the copies' blocks are."""
        sequences = as_batch(batch)
        for index, sequence in enumerate(sequences):
            if sequence.dtype == object:
                raise TypeError(f"sequence {index} holds Python objects (high-precision tokens?): a torch layer "
                                "answers in its own float dtype, run the extraction with precision=None")
        lengths = np.array([len(s) for s in sequences])
        groups = [(index, lambda index=index: torch.as_tensor(np.stack([sequences[i] for i in index]),
                                                     device=self.device).to(self.dtype))
                  for index in (np.flatnonzero(lengths == length) for length in np.unique(lengths))]
        return groups, len(sequences)

    def _copies_groups(self, batch):
        """Copies-instances (the targeted schedules' queries, :func:`~mhaextract.oracle.queries.rows_of`):
        the queries of each copy count built on the module's device from their two rows ``(x, z)``,
        ``(y, .., y, x)`` with ``y = x - z`` in float64 as :func:`~mhaextract.oracle.queries.copies_block`
        forms it, without stacking the batch's sequences one by one on the host (or sending ``k + 1``
        rows a query to a GPU instead of two). The same tokens, so the same answers, as any batch of
        those sequences. ``(groups, count)``, or None for any other batch."""
        rows = rows_of(batch)
        if rows is None:
            return None
        segments = rows.segments
        if not all(np.issubdtype(np.asarray(part).dtype, np.floating) for finals, differences, _ in segments
                   for part in (finals, differences)):
            return None
        starts = np.cumsum([0] + [len(finals) for finals, _, _ in segments])
        groups = []
        for k in sorted({k for _, _, k in segments}):
            picked = [n for n, segment in enumerate(segments) if segment[2] == k]
            index = np.concatenate([np.arange(starts[n], starts[n + 1]) for n in picked])

            def build(picked=picked, k=k):
                finals = torch.as_tensor(np.concatenate([segments[n][0] for n in picked]), device=self.device)
                differences = torch.as_tensor(np.concatenate([segments[n][1] for n in picked]), device=self.device)
                block = torch.empty((len(finals), k + 1, finals.shape[-1]),
                                    dtype=torch.promote_types(finals.dtype, differences.dtype), device=self.device)
                torch.sub(finals, differences, out=block[:, 0])
                block[:, 1:k] = block[:, :1]
                block[:, k] = finals
                return block.to(self.dtype)
            groups.append((index, build))
        return groups, len(rows)

    @property
    def position_evidence(self) -> list:
        """The module's outputs at every position of a few of the last sequences it answered (at least
        three tokens, the first two different: not the copies-instances' repeated tokens), as pairs
        ``(X (N, d), outputs (N, d_out))`` (``(N,)`` read out), float64: what ``extract`` judges the
        layer's causality from (:mod:`mhaextract.checks.causality`), without a query more."""
        return list(self._evidence)

    def _keep_evidence(self, X: torch.Tensor, every: torch.Tensor) -> None:
        """The group's last sequence, if it can tell a causal layer from a bidirectional one."""
        if X.shape[1] < 3 or torch.equal(X[-1, 0], X[-1, 1]):
            return
        # copies: in float64 ``every[-1]`` and ``X[-1]`` are views that would keep the whole batch's
        # outputs and tokens (eight kept: about 170 MB at d = 768)
        outputs = every[-1].to(torch.float64).cpu().numpy().copy()
        if self.readout is not None:
            outputs = read_out(outputs, self.readout, self._single)
        self._evidence.append((X[-1].to(torch.float64).cpu().numpy().copy(), outputs))

    def _every_position(self, X: torch.Tensor) -> torch.Tensor:
        """The module's outputs at every position for a batch (B, N, d) -> (B, N, d_out)."""
        try:
            return self._call_module(X)
        except (RuntimeError, TypeError, IndexError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            # a shape error names the token dimension first: a wrong d is the commonest cause of it
            shape = any(word in first for word in ("shape", "size", "dimension", "mat1", "mat2"))
            cause = (f"if the layer's hidden size is not d = {X.shape[-1]}, pass its hidden size as d (extract(oracle, "
                     "d=hidden_size, ...)); else " if shape else "")
            raise TypeError(
                f"{type(self._original).__name__} raised {type(error).__name__} ({first}) when called on a batch of "
                f"token vectors of shape {tuple(X.shape)} and dtype {X.dtype}: {cause}TorchOracle calls the attention "
                "module itself on token vectors (B, N, d), not a model that takes token ids (for GPT-2 pass "
                "model.h[i].attn, for BERT model.encoder.layer[i].attention.self)") from error

    def _call_module(self, X: torch.Tensor) -> torch.Tensor:
        if isinstance(self.module, nn.MultiheadAttention):
            if not self.module.batch_first:
                X = X.transpose(0, 1)  # (N, B, d)
            output = self.module(X, X, X, need_weights=False)[0]
            return output if self.module.batch_first else output.transpose(0, 1)
        output = self.module(X)
        if isinstance(output, (tuple, list)):
            output = output[0]
        if not isinstance(output, torch.Tensor) or output.dim() != 3:
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"the module must map (B, N, d) to (B, N, d_out); it returned {shape}")
        return output


class ReducedAttention(nn.Module):
    """A :class:`~mhaextract.MultiHeadAttention` as a torch module computing the same final-token f.

    ``forward(X)`` takes tokens (B, N, d) (or one sequence (N, d)) and returns f per sequence,
    (B,) for the scalar model, (B, d_out) for the vector model (or one of them for one sequence):
    ``f(X) = c + sum_h V_h sum_i softmax_i(x_i^T (W_h x_N + u_h)) x_i``. ``W`` (H, d, d), ``V``
    (H, d_out, d), ``u`` (H, d) and ``c`` (d_out,) are float64 parameters.

    Examples
    --------
    >>> import numpy as np, torch
    >>> import mhaextract as mx
    >>> from mhaextract.adapters.torch import ReducedAttention
    >>> model = mx.MultiHeadAttention.random(d=3, heads=2, seed=0, bias=True)
    >>> X = np.random.default_rng(0).standard_normal((2, 5, 3))
    >>> out = ReducedAttention(model)(torch.as_tensor(X)).detach()
    >>> out.shape, bool(np.allclose(out.numpy(), model(list(X))))
    (torch.Size([2]), True)
    """

    def __init__(self, model: MultiHeadAttention):
        super().__init__()
        model = model.to_float64()
        self.vector = model.is_vector
        self.W = nn.Parameter(torch.as_tensor(model.W, dtype=torch.float64))
        self.V = nn.Parameter(torch.as_tensor(model.V, dtype=torch.float64))
        self.u = nn.Parameter(torch.as_tensor(model.u, dtype=torch.float64))
        self.c = nn.Parameter(torch.as_tensor(np.reshape(model.c, -1), dtype=torch.float64))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        single = X.dim() == 2
        X = X[None] if single else X
        if X.dim() != 3 or X.shape[-1] != self.W.shape[-1]:
            raise ValueError(f"expected tokens of shape (B, N, {self.W.shape[-1]}), got {tuple(X.shape)}")
        X = X.to(self.W.dtype)
        queries = torch.einsum("hde,be->bhd", self.W, X[:, -1]) + self.u[None]  # W_h x_N + u_h
        weights = torch.softmax(torch.einsum("bnd,bhd->bhn", X, queries), dim=-1)
        means = torch.einsum("bhn,bnd->bhd", weights, X)  # m_h(X)
        f = torch.einsum("bhd,hod->bo", means, self.V) + self.c
        f = f if self.vector else f[:, 0]
        return f[0] if single else f


@dataclass
class HeadFactors:
    """A model's heads factored at a common width r: scores ``(Q_h x_N + b_h)^T (K_h x_i)`` and
    values ``O_h P_h x_i``. Q, K, P (H, r, d), b (H, r), O (H, d_out, r), c (d_out,); ``report``:
    what the factoring cut (:class:`~mhaextract.adapters.export.ExportReport`, errors not measured)."""

    Q: np.ndarray
    b: np.ndarray
    K: np.ndarray
    P: np.ndarray
    O: np.ndarray
    c: np.ndarray
    report: ExportReport | None = None

    @property
    def width(self) -> int:
        return self.Q.shape[1]

    def model(self) -> MultiHeadAttention:
        """The vector model the factors compute: ``W_h = K_h^T Q_h``, ``u_h = K_h^T b_h``, ``V_h = O_h P_h``."""
        return MultiHeadAttention(np.einsum("hrd,hre->hde", self.K, self.Q), np.einsum("hor,hrd->hod", self.O, self.P),
                                  np.einsum("hrd,hr->hd", self.K, self.b), self.c)


def head_factors(model: MultiHeadAttention, width: int | None = None, tolerance: float = 0.0,
                 target: str | None = None) -> HeadFactors:
    """Factor every head: ``[W_h | u_h] = K_h^T [Q_h | b_h]`` and ``V_h = O_h P_h`` by SVD, at ``width``
    (None: the largest numerical rank of any head's factors, :func:`numerical_rank`). A factor of
    rank above ``width`` is cut only where the cut is below the numerical gap or within
    ``tolerance`` (docs/algorithm.md, "The whole layer: vector outputs and a replacement module");
    otherwise :class:`UnsupportedLayerError` names the head, the factor and its rank.

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> from mhaextract.adapters.torch import head_factors
    >>> model = mx.MultiHeadAttention.random(d=6, heads=2, seed=0, rank=2, d_out=6)
    >>> factors = head_factors(model)
    >>> factors.width                      # V_h is full rank: the widest factor sets the width
    6
    >>> bool(np.allclose(factors.K[0].T @ factors.Q[0], model.W[0]))
    True
    """
    model = model.to_float64()
    H, d, d_out = model.heads, model.d, model.d_out
    scores = [np.hstack([model.W[h], model.u[h][:, None]]) for h in range(H)]
    values = [model.V[h] for h in range(H)]
    if width is None:
        width = max([1] + [numerical_rank(np.linalg.svd(m, compute_uv=False)) for m in scores + values])
    remedy = CLASS_REMEDY if target else "pass a width of at least {rank}, or width=None (each head at its rank)"
    target = target or "the layer to_torch builds"
    report = ExportReport(target, tolerance)
    Q, K, P = (np.zeros((H, width, d)) for _ in range(3))
    b, O = np.zeros((H, width)), np.zeros((H, d_out, width))
    for h in range(H):
        K_t, Q_b = factor_at_width(scores[h], width, tolerance, f"head {h}'s scores [W_h | u_h]", target, report,
                                   remedy)
        O[h], P[h] = factor_at_width(values[h], width, tolerance, f"head {h}'s values V_h", target, report, remedy)
        K[h], Q[h], b[h] = K_t.T, Q_b[:, :d], Q_b[:, d]
    return HeadFactors(Q, b, K, P, O, np.reshape(np.asarray(model.c, dtype=np.float64), -1).copy(), report)


class ExtractedAttention(nn.Module):
    """An extracted model as an attention layer: tokens (B, N, d) to outputs (B, N, d_out) at every position.

    Head h scores key j from position i as ``(Q_h x_i + b_h)^T (K_h x_j)`` and adds ``O_h P_h`` times
    the attention-weighted mean of the tokens; ``causal=True`` lets position i see tokens j <= i
    (a decoder's layer: the output at i is the final-token model on the prefix), ``causal=False``
    all tokens (an encoder's). The final-token answers an oracle gives cannot tell the two apart;
    the layer's outputs at earlier positions can (``result.causal``, which ``to_torch(result)``
    follows). Parameters (float64 by default): Q, K, P (H, r, d), b (H, r),
    O (H, d_out, r), c (d_out,).

    Examples
    --------
    >>> import numpy as np, torch
    >>> import mhaextract as mx
    >>> from mhaextract.adapters.torch import ExtractedAttention, head_factors
    >>> model = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, d_out=3, bias=True)
    >>> encoder = ExtractedAttention(head_factors(model), causal=False)
    >>> X = torch.randn(1, 6, 4, dtype=torch.float64)
    >>> out = encoder(X).detach()              # position 0 attends to all six tokens
    >>> bool(np.allclose(out[0, 0].numpy(), model([X[0, [1, 2, 3, 4, 5, 0]].numpy()])[0]))
    True
    """

    def __init__(self, factors: HeadFactors, causal: bool, dtype=torch.float64):
        super().__init__()
        self.causal = bool(causal)
        for name in ("Q", "b", "K", "P", "O", "c"):
            setattr(self, name, nn.Parameter(torch.as_tensor(getattr(factors, name), dtype=dtype)))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        single = X.dim() == 2
        X = X[None] if single else X
        if X.dim() != 3 or X.shape[-1] != self.Q.shape[-1]:
            raise ValueError(f"expected tokens of shape (B, N, {self.Q.shape[-1]}), got {tuple(X.shape)}")
        X = X.to(self.Q.dtype)
        queries = torch.einsum("hrd,bnd->bhnr", self.Q, X) + self.b[None, :, None, :]
        keys = torch.einsum("hrd,bnd->bhnr", self.K, X)
        scores = queries @ keys.transpose(-1, -2)  # (B, H, N, N): query position, key position
        if self.causal:
            N = X.shape[1]
            hidden = torch.ones(N, N, dtype=torch.bool, device=X.device).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        values = torch.einsum("hrd,bnd->bhnr", self.P, X)
        out = torch.einsum("hor,bhnr->bno", self.O, weights @ values) + self.c
        return out[0] if single else out
