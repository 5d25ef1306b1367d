"""mhaextract: learn multi-head softmax attention from black-box value queries.

Implements "Provably Learning Multi-Head Attention with Queries" (arXiv 2608.03294); the
mathematics and the query schedules are in docs/algorithm.md.
"""

from .api import extract
from .checks.base import Check, ExtractionError, UnreliableExtractionWarning
from .checks.verify import Verification, verify
from .compare import Comparison, compare
from .model import MultiHeadAttention
from .oracle.boundary import BudgetExceeded, OracleError
from .oracle.noise import (
    AdditiveNoise, BFloat16Oracle, Float32Oracle, GaussianNoise, MixedPrecisionOracle, RoundedAnswers,
)
from .oracle.parallel import ParallelOracle
from .oracle.simulated import SimulatedOracle
from .rotary.model import RotaryAttention
from .oracle.transcript import TranscriptError
from .results import Extraction, load_model, save_extraction
from .transformer import TransformerExtraction, TransformerExtractionError, extract_transformer
from .transformer_model import Transformer1L, TransformerComparison, compare_transformers

__all__ = [
    "RotaryAttention",
    "AdditiveNoise", "BFloat16Oracle", "BudgetExceeded", "Check", "Comparison", "Extraction", "ExtractionError",
    "Float32Oracle", "GaussianNoise", "MixedPrecisionOracle", "MultiHeadAttention", "OracleError", "RoundedAnswers",
    "ParallelOracle", "SimulatedOracle", "TranscriptError",
    "Transformer1L", "TransformerComparison", "TransformerExtraction", "TransformerExtractionError",
    "UnreliableExtractionWarning", "Verification", "compare", "compare_transformers", "extract",
    "extract_transformer", "load_model", "save_extraction", "verify",
]
__version__ = "0.1.0"
