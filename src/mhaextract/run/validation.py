"""Parameter validation at the public boundary: one copy of each rule, one wording of each error.

Every public entry point (``extract``, ``extract_transformer``, the baselines, ``verify``, the CLI)
checks its parameters here, once, and raises ``ValueError`` naming the parameter, what it must be
and what it got. The default token scale lives here too (docs/algorithm.md, 'Numerics in float64 and the token scale').
"""

from __future__ import annotations

import warnings

import numpy as np

ON_FAILURE = ("raise", "warn")


def positive_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (bools refused), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def positive_number(name: str, value) -> float:
    """``value`` as a finite float > 0, or a ValueError naming ``name``."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not np.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return number


def nonnegative_number(name: str, value, meaning: str = "", wrong_type=TypeError) -> float:
    """``value`` as a finite float >= 0 (an error bound, a noise level), or a clear error.

    Not a number (strings included) raises ``wrong_type``; NaN, infinite or negative raises
    ValueError. ``meaning`` says what the number bounds, for the message."""
    about = f" ({meaning})" if meaning else ""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise wrong_type(f"{name} must be a number{about}, got {value!r}") from None
    if not np.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0{about}, got {value!r}")
    return number


def on_failure_mode(value) -> str:
    if value not in ON_FAILURE:
        raise ValueError(f"on_failure must be 'raise' or 'warn', got {value!r}")
    return value


def default_token_scale(d: int) -> float:
    """``d ** 0.25``: the norm at which ``z^T W x`` is of order one for W with N(0, 1/d) entries
    (docs/algorithm.md, 'Numerics in float64 and the token scale')."""
    return float(d) ** 0.25


def token_scale_for(d: int, token_scale) -> float:
    """The token scale of a run: the given one (validated) or :func:`default_token_scale`."""
    if token_scale is None:
        return default_token_scale(d)
    return positive_number("token_scale", token_scale)


def token_scale_option(token_scale):
    """``extract``'s ``token_scale``: ``"auto"`` (found by probe queries, docs/algorithm.md, 'Choosing the token scale
    from queries'), None (the schedule's default) or a positive number."""
    if isinstance(token_scale, str):
        if token_scale != "auto":
            raise ValueError(f"token_scale must be a positive number, 'auto' or None, got {token_scale!r}")
        return token_scale
    if token_scale is None:
        return None
    return positive_number("token_scale", token_scale)


def bias_option(bias):
    """``extract``'s ``bias``: True, False or None (the schedule's default)."""
    if bias is not None and not isinstance(bias, (bool, np.bool_)):
        raise ValueError(f"bias must be True, False or None (the schedule's default), got {bias!r}")
    return None if bias is None else bool(bias)


#: ``rank="auto"``: the low-rank schedule finds each head's rank by queries.
FOUND_RANK = "auto"


def rank_option(rank, d: int, meaning: str = "a bound on the rank of every W_h"):
    """``extract``'s ``rank``: None, ``"auto"`` or an int 1 <= r <= d (``meaning``: what it bounds,
    for the error)."""
    if rank is None or rank == FOUND_RANK:
        return rank
    if isinstance(rank, str):
        raise ValueError(f"rank must be an integer 1 <= r <= d = {d} or {FOUND_RANK!r}, got {rank!r}")
    rank = positive_int("rank", rank)
    if rank > d:
        raise ValueError(f"rank must be at most d = {d} ({meaning}), got {rank}")
    return rank


def head_count(heads, max_heads) -> tuple[int, int | None]:
    """``(H0, H or None)`` from exactly one of ``heads`` (H known) and ``max_heads`` (a bound)."""
    if (heads is None) == (max_heads is None):
        raise ValueError("give exactly one of heads (H known) or max_heads (a bound H0 >= H*)")
    if heads is not None:
        H = positive_int("heads", heads)
        return H, H
    return positive_int("max_heads", max_heads), None


def seed_option(seed):
    """``extract``'s ``seed``: None (fresh entropy) or an integer >= 0 (numpy integers too, bools
    refused), as an int: the run derives every random stream from it (:func:`spawn_rng`)."""
    if seed is None:
        return None
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be None or an integer >= 0 (the same seed asks the same queries), got {seed!r}")
    return int(seed)


def resumable_seed(seed):
    """A transcript's run must ask the same queries again: it needs an integer seed >= 0 (:func:`seed_option`
    without None)."""
    try:
        checked = seed_option(seed)
    except ValueError:
        checked = None
    if checked is None:
        raise ValueError(f"transcript= needs an integer seed >= 0 (the resumed run must ask the same queries), "
                         f"got seed={seed!r}")
    return checked


def spawn_rng(seed, stream: int) -> np.random.Generator:
    """An independent random stream ``stream`` (>= 1) derived from ``seed`` (the schedule uses the
    seed itself): extra queries (refinement, verification) never repeat the schedule's."""
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(stream)[stream - 1])


def renamed(old: str, old_value, new: str, new_value, default):
    """The value of option ``new`` where a caller still passes it as ``old`` (a FutureWarning says
    so; both given is a ValueError). The verification vocabulary is ``verify_queries`` (how many
    fresh queries) and ``verify_length`` (the longest, in tokens); results report what was asked as
    ``verification_queries`` and ``verification_length``."""
    if old_value is None:
        return new_value
    if new_value is not default:
        raise ValueError(f"give {new}= only ({old}= is its former name)")
    warnings.warn(f"{old}= is now {new}=", FutureWarning, stacklevel=3)
    return old_value
