"""mhaextract: learn multi-head softmax attention from black-box value queries.

Implements "Provably Learning Multi-Head Attention with Queries" (arXiv 2608.03294); the
mathematics and the query schedule are in docs/algorithm.md.
"""

from .compare import Comparison, compare
from .learner import Check, Extraction, ExtractionError, UnreliableExtractionWarning, extract
from .model import MultiHeadAttention
from .noise import AdditiveNoise, Float32Oracle, GaussianNoise, RoundedAnswers
from .oracle import BudgetExceeded, OracleError, SimulatedOracle
from .results import load_model, save_extraction
from .transcript import TranscriptError
from .transformer import (
    Transformer1L, TransformerComparison, TransformerExtraction, TransformerExtractionError, compare_transformers,
    extract_transformer,
)
from .verify import Verification, verify

__all__ = [
    "AdditiveNoise", "BudgetExceeded", "Check", "Comparison", "Extraction", "ExtractionError", "Float32Oracle",
    "GaussianNoise", "MultiHeadAttention", "OracleError", "RoundedAnswers", "SimulatedOracle", "TranscriptError",
    "Transformer1L", "TransformerComparison", "TransformerExtraction", "TransformerExtractionError",
    "UnreliableExtractionWarning", "Verification", "compare", "compare_transformers", "extract",
    "extract_transformer", "load_model", "save_extraction", "verify",
]
__version__ = "0.1.0"
