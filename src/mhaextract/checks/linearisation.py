"""The algebraic pipeline's linearisation (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
refinement, verification'): what a float64 grid run hands its certificate (:class:`PipelineRun`), and the run's
derivative as sparse per-instance blocks plus the dense combination and assembly (:class:`PipelineOperator`), which
:func:`~mhaextract.checks.certificate.pipeline_certificate` bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from scipy.sparse import csr_matrix, diags
from scipy.sparse.linalg import splu

from ..models.attention import MultiHeadAttention
from ..numerics.assembly import label_columns
from ..numerics.rational import instance_jacobian, lu_inverses

#: Columns (answers) of G per chunk when accumulating row norms.
CHUNK = 512


@dataclass
class PipelineRun:
    """What the certificate of an algebraic float64 run needs, as the learner computed it.

    schedule : the PaperSchedule; owners, copies : (Q,) instance and copy count of each answer;
    c : (n,) constants; m, l : (n, r) log-poles and labels with heads in reference order;
    pole_weights, label_weights : (n, r) the combination weights used; design : sparse (n, d^2)
    which ``M`` entries each instance measures (row/column links measure sums);
    model : the assembled heads; answers : (Q,) the answers.
    """

    schedule: object
    owners: np.ndarray
    copies: np.ndarray
    c: np.ndarray
    m: np.ndarray
    l: np.ndarray
    pole_weights: np.ndarray
    label_weights: np.ndarray
    design: csr_matrix
    model: MultiHeadAttention
    answers: np.ndarray
    ranks: np.ndarray  # (n,) pole count detected on each instance


def _pseudo_inverse(J: np.ndarray) -> np.ndarray:
    """``J^+`` of every matrix of a batch (n, K, p): ``J^{-1}`` where J is square and well conditioned
    (:func:`~mhaextract.numerics.rational.lu_inverses`: the same matrix as the pseudo-inverse, to
    ``INVERSE_CONDITION`` times the rounding unit), else ``np.linalg.pinv``."""
    out, inverted = lu_inverses(J)
    if not inverted.all():
        out[~inverted] = np.linalg.pinv(J[~inverted])
    return out


# ---------------------------------------------------------------- the algebraic pipeline
class PipelineOperator:
    """The run's derivative as sparse per-instance blocks plus the dense combination/assembly."""

    def __init__(self, run: PipelineRun):
        self.run = run
        schedule = run.schedule
        self.d = schedule.d
        self.ks = np.asarray(schedule.ks)
        self.K = len(self.ks)
        self.n, self.r = run.m.shape
        self.Q = len(run.owners)
        with np.errstate(all="ignore"):
            self.finite = np.isfinite(run.m).all(axis=1) & np.isfinite(run.l).all(axis=1) & np.isfinite(run.c)
        self._anchors = self._anchoring()
        self._layout = self._direct_layout()  # the paper's layout, or None

    @cached_property
    def G_u(self) -> csr_matrix:
        """(n (2r + 1), Q): d(c, m, l)_t / d answers. Formed on demand (the amplification, the
        sensitivity matrix): the row norms the validity needs come from its blocks without it."""
        return self._instance_operator()

    def _pseudo_inverses(self, index: np.ndarray) -> np.ndarray:
        """``J_t^+`` (len(index), 2r + 1, K); zero for failed fits (weight 0 in the combination)."""
        out = np.zeros((len(index), 2 * self.r + 1, self.K))
        good = index[self.finite[index]]
        if len(good):
            J = instance_jacobian(self.ks, np.exp(self.run.m[good]), self.run.l[good])
            out[self.finite[index]] = _pseudo_inverse(J)
        return out

    def _block(self, index: np.ndarray, pinv: np.ndarray) -> csr_matrix:
        """Block-diagonal ``J_t^+`` for instances ``index``: (len * (2r + 1), n * K) over sample rows."""
        size = 2 * self.r + 1
        rows = (np.arange(len(index))[:, None, None] * size + np.arange(size)[None, :, None]) + 0 * np.arange(self.K)
        cols = index[:, None, None] * self.K + np.arange(self.K)[None, None, :] + 0 * rows
        return csr_matrix((pinv.ravel(), (rows.ravel(), cols.ravel())), shape=(len(index) * size, self.n * self.K))

    def _anchoring(self) -> dict:
        """The sample rows read straight from answers (S0, as triplets), and the injected F(0) of
        the instances after row 0: ``vbar^T x_i`` on the support columns (row 0's answers, q00)."""
        run, schedule, K, Q = self.run, self.run.schedule, self.K, self.Q
        grid, row_links = schedule.grid_index, schedule.row_link_index
        # Samples that are answers: row t*K + k holds answer q.
        position = np.searchsorted(self.ks, run.copies)
        rows, cols, values = [run.owners * K + position], [np.arange(Q)], [np.ones(Q)]
        q00 = int(np.flatnonzero((run.owners == grid[0, 0]) & (run.copies == self.ks[0]))[0])
        row0 = grid[0]
        # Row 0 (j >= 1) and the row links: F(0) = vbar^T x_0, the one-token answer q00.
        anchored = np.concatenate([row0[1:], row_links[1:]])
        rows.append(anchored * K)
        cols.append(np.full(len(anchored), q00))
        values.append(np.ones(len(anchored)))
        S0 = csr_matrix((np.concatenate(values), (np.concatenate(rows), np.concatenate(cols))), shape=(self.n * K, Q))
        # Row 0's constants c_j, then vbar = Z^{-T} (F(0) - c) and vbar^T x_i: these depend on
        # row 0's answers only, so they are dense on few columns.
        dc = (self._block(row0, self._pseudo_inverses(row0)) @ S0)[::2 * self.r + 1]
        support = np.union1d(dc.indices, [q00])
        anchor = (support == q00).astype(float)
        dvbar = np.linalg.solve(schedule.Z.T, anchor[None, :] - dc[:, support].toarray())  # (d, |support|)
        dvx = schedule.X.T @ dvbar  # row i: d(vbar^T x_i) on the support columns
        return dict(rows=rows, cols=cols, values=values, support=support, anchor=anchor, dvx=dvx, q00=q00,
                    anchored=anchored, position=position)

    def _instance_operator(self) -> csr_matrix:
        if self._layout is not None:
            return self._direct_operator(self._layout)
        schedule, K, d = self.run.schedule, self.K, self.d
        grid, column_links = schedule.grid_index, schedule.column_link_index
        a = self._anchors
        rows, cols, values = list(a["rows"]), list(a["cols"]), list(a["values"])
        support, anchor, dvx = a["support"], a["anchor"], a["dvx"]
        for i in range(1, d):
            for t, extra in [(grid[i], 0.0), (column_links[i], 1.0)]:
                t = np.asarray(t)
                rows.append(np.repeat(t * K, len(support)))
                cols.append(np.tile(support, len(t)))
                values.append(np.tile(dvx[i] + extra * anchor, len(t)))
        S = csr_matrix((np.concatenate(values), (np.concatenate(rows), np.concatenate(cols))),
                       shape=(self.n * K, self.Q))
        everything = np.arange(self.n)
        return (self._block(everything, self._pseudo_inverses(everything)) @ S).tocsr()

    def _direct_layout(self) -> dict | None:
        """The blocks of ``J^+ S`` (:meth:`_instance_operator`) for the paper's layout, or None: an
        instance's samples read distinct answers (its own, the anchor q00, or vbar^T x_i on the
        support), so every entry of row block t is one product ``J_t^+[p, k] S[t K + k, q]``. Needs
        the instances after row 0 and its links in one trailing range, equal answer counts, their
        answers after the support. ``head``: (columns, values) of the first instances (row 0, its
        links), columns sorted; the later ones (instances ``first..n-1``) read the support through
        ``J_t^+[:, 0]`` times the row ``dvx[final] + extra * anchor`` and their own answers ``own``
        through ``J_t^+[:, position]``."""
        run, schedule, Q, n, d = self.run, self.run.schedule, self.Q, self.n, self.d
        a = self._anchors
        support, q00, anchored, position = a["support"], a["q00"], a["anchored"], a["position"]
        grid, column_links = schedule.grid_index, schedule.column_link_index
        # The instances _instance_operator anchors on the support: grid row i (extra 0), column links (1).
        rows = range(1, d)
        later = np.concatenate([np.concatenate([grid[i], column_links[i]]) for i in rows] or [[]]).astype(int)
        extra = np.concatenate([np.concatenate([np.zeros(len(grid[i])), np.ones(len(column_links[i]))])
                                for i in rows] or [[]])
        final = np.concatenate([np.full(len(grid[i]) + len(column_links[i]), i) for i in rows] or [[]]).astype(int)
        if run.owners.min(initial=0) < 0:
            return None
        first = n - len(later)
        if not np.array_equal(np.sort(later), np.arange(first, n)) or np.isin(anchored, later).any():
            return None
        counts = np.bincount(run.owners, minlength=n)
        if len(later) and (counts[later] != counts[later[0]]).any():
            return None
        order = np.argsort(run.owners, kind="stable")  # answers grouped by instance, in query order
        starts = np.concatenate([[0], np.cumsum(counts)])
        if len(later) and order[starts[first]:].min(initial=Q) <= support.max(initial=-1):
            return None
        pinv = self._pseudo_inverses(np.arange(n))
        head = []
        lead = set(int(t) for t in anchored)
        for t in range(first):  # row 0, its links: own answers (and the anchor q00)
            own = order[starts[t]:starts[t + 1]]
            cols = np.concatenate([[q00], own]) if t in lead else own
            ks = np.concatenate([[0], position[own]]) if t in lead else position[own]
            if len(np.unique(cols)) != len(cols):
                return None
            sort = np.argsort(cols, kind="stable")
            head.append((cols[sort], pinv[t][:, ks[sort]] * 1.0))
        rank = np.argsort(later)  # instances first..n-1 in order
        return dict(first=first, head=head, pinv=pinv, final=final[rank], extra=extra[rank],
                    own=order[starts[first]:].reshape(len(later), -1) if len(later) else np.zeros((0, 0), dtype=int))

    def _direct_operator(self, layout: dict) -> csr_matrix:
        """``J^+ S`` built row block by row block from :meth:`_direct_layout`, not as a sparse
        product: each entry the single product the sparse product forms; zeros dropped and indices
        sorted as there."""
        size, Q, n = 2 * self.r + 1, self.Q, self.n
        a = self._anchors
        support, anchor, dvx, position = a["support"], a["anchor"], a["dvx"], a["position"]
        first, head, own = layout["first"], layout["head"], layout["own"]
        later = n - first
        width = len(support) + own.shape[1]
        # Rows t * size + p: instances before `first` one by one (few), the later ones as one block.
        widths = np.concatenate([np.repeat([len(cols) for cols, _ in head], size).astype(np.int64),
                                 np.full(later * size, width, dtype=np.int64)])
        indptr = np.concatenate([[0], np.cumsum(widths)])
        index_type = np.int32 if max(indptr[-1], Q) < 2**31 else np.int64
        data, indices = np.empty(indptr[-1]), np.empty(indptr[-1], dtype=index_type)
        offset = 0
        for cols, values in head:
            data[offset:offset + values.size] = values.ravel()
            indices[offset:offset + values.size] = np.tile(cols, size)
            offset += values.size
        if later:
            values = dvx[layout["final"]] + layout["extra"][:, None] * anchor[None, :]  # (later, |support|)
            P = layout["pinv"][first:]
            block = data[offset:].reshape(later, size, width)
            np.multiply(P[:, :, 0][:, :, None], values[:, None, :], out=block[:, :, :len(support)])
            block[:, :, len(support):] = np.take_along_axis(P, position[own][:, None, :], axis=2) * 1.0
            columns = indices[offset:].reshape(later, size, width)
            columns[:, :, :len(support)] = support
            columns[:, :, len(support):] = own[:, None, :]
        indptr = indptr.astype(index_type)
        out = csr_matrix((data, indices, indptr), shape=(n * size, Q))
        out.eliminate_zeros()
        return out

    def rows(self, what: str, h: int) -> csr_matrix:
        """(n, Q): derivative of every instance's m_h (``what="m"``) or l_h (``"l"``)."""
        offset = 1 + h if what == "m" else 1 + self.r + h
        return self.G_u[offset::2 * self.r + 1]

    def row_norms(self, what: str, order: int) -> np.ndarray:
        """(n, r) l1 (order=1) or l2 (order=2) norms of the rows of m_h or l_h."""
        return np.where(self.finite[:, None], self._row_norms[what, order], np.inf)

    @cached_property
    def _row_norms(self) -> dict:
        """Both norms of every row block, each block's absolute values formed once. In the paper's
        layout from the blocks of :meth:`_direct_layout` without forming ``G_u`` (O(d^3 H^2)
        entries): a later instance's row reads the support through ``J_t^+[p, 0]`` times a row of
        ``dvx`` shared by every instance with its final token, so its norms there are
        ``|J_t^+[p, 0]|`` times that row's (the same sums to rounding)."""
        size = 2 * self.r + 1
        if self._layout is None:
            norm1, norm2 = self._csr_norms(self.G_u)
        else:
            norm1, norm2 = self._layout_norms(self._layout)
        out = {}
        for what in ("m", "l"):
            first = 1 if what == "m" else 1 + self.r
            out[what, 1] = norm1.reshape(self.n, size)[:, first:first + self.r].copy()
            out[what, 2] = norm2.reshape(self.n, size)[:, first:first + self.r].copy()
        return out

    @staticmethod
    def _csr_norms(matrix: csr_matrix) -> tuple[np.ndarray, np.ndarray]:
        block = abs(matrix)
        return (np.asarray(block.sum(axis=1)).ravel(), np.sqrt(np.asarray(block.multiply(block).sum(axis=1)).ravel()))

    def _layout_norms(self, layout: dict) -> tuple[np.ndarray, np.ndarray]:
        size, n = 2 * self.r + 1, self.n
        a = self._anchors
        first, head, own = layout["first"], layout["head"], layout["own"]
        norm1, norm2 = np.empty(n * size), np.empty(n * size)
        if head:
            widths = np.repeat([len(cols) for cols, _ in head], size)
            indptr = np.concatenate([[0], np.cumsum(widths)])
            data = np.concatenate([values.ravel() for _, values in head])
            indices = np.concatenate([np.tile(cols, size) for cols, _ in head])
            norm1[:first * size], norm2[:first * size] = self._csr_norms(
                csr_matrix((data, indices, indptr), shape=(first * size, self.Q)))
        if first < n:
            keys, which = np.unique(layout["final"] * 2 + layout["extra"].astype(int), return_inverse=True)
            shared = a["dvx"][keys // 2] + (keys % 2)[:, None] * a["anchor"][None, :]  # one row per final token
            P = layout["pinv"][first:]
            P_own = np.abs(np.take_along_axis(P, a["position"][own][:, None, :], axis=2))
            P_0 = np.abs(P[:, :, 0])
            norm1[first * size:] = (P_0 * np.abs(shared).sum(axis=1)[which][:, None] + P_own.sum(axis=2)).ravel()
            norm2[first * size:] = np.sqrt(P_0**2 * (shared**2).sum(axis=1)[which][:, None]
                                           + (P_own**2).sum(axis=2)).ravel()
        return norm1, norm2

    def columns(self, chunk: int = CHUNK):
        """Yield (columns, dW (H, d, d, c), dv (H, d, c)): G restricted to a chunk of answers."""
        run, schedule, d = self.run, self.run.schedule, self.d
        Z_inv_T = np.linalg.inv(schedule.Z.T)
        X_inv = np.linalg.inv(schedule.X)
        A = run.design
        columns, measures = label_columns(schedule)
        factors, pole_rhs, label_ops = [], [], []
        for h in range(self.r):
            w = np.where(self.finite, run.pole_weights[:, h], 0.0)
            Aw = diags(w) @ A
            factors.append(splu((A.T @ Aw).tocsc()))
            pole_rhs.append((Aw.T @ self.rows("m", h)).tocsc())  # A^T W dm_h
            lw = np.where(self.finite, run.label_weights[:, h], 0.0) * measures
            L = csr_matrix((lw, (columns, np.arange(self.n))), shape=(d, self.n))
            total = np.maximum(np.asarray(L.sum(axis=1)).ravel(), 1e-300)
            label_ops.append((diags(1.0 / total) @ L @ self.rows("l", h)).tocsc())
        for start in range(0, self.Q, chunk):
            cols = np.arange(start, min(start + chunk, self.Q))
            dW = np.empty((self.r, d, d, len(cols)))
            dv = np.empty((self.r, d, len(cols)))
            for h in range(self.r):
                dM = factors[h].solve(pole_rhs[h][:, cols].toarray()).reshape(d, d, len(cols))  # [j, i, q]
                dW[h] = np.einsum("aj,jiq,ib->abq", Z_inv_T, dM, X_inv)
                dv[h] = Z_inv_T @ label_ops[h][:, cols].toarray()
            yield cols, dW, dv
