"""mhaextract: learn multi-head softmax attention from black-box value queries.

Implements "Provably Learning Multi-Head Attention with Queries" (arXiv 2608.03294); the
mathematics and the query schedule are in docs/algorithm.md.
"""

from .compare import Comparison, compare
from .learner import Check, Extraction, ExtractionError, UnreliableExtractionWarning, extract
from .model import MultiHeadAttention
from .oracle import BudgetExceeded, OracleError, SimulatedOracle
from .results import load_model, save_extraction
from .transcript import TranscriptError

__all__ = [
    "BudgetExceeded", "Check", "Comparison", "Extraction", "ExtractionError", "MultiHeadAttention",
    "OracleError", "SimulatedOracle", "TranscriptError", "UnreliableExtractionWarning", "compare", "extract",
    "load_model", "save_extraction",
]
__version__ = "0.1.0"
