"""mhaextract: learn multi-head softmax attention from black-box value queries.

Implements "Provably Learning Multi-Head Attention with Queries" (arXiv 2608.03294); the
mathematics and the query schedules are in docs/algorithm.md.
"""

from .api import extract
from .checks.base import Check, ExtractionError, UnreliableExtractionWarning
from .checks.verify import Verification, verify
from .models.compare import Comparison, compare
from .models.attention import MultiHeadAttention
from .oracle.boundary import BudgetExceeded, OracleError
from .oracle.noise import (
    AdditiveNoise, BFloat16Oracle, Float32Oracle, GaussianNoise, MixedPrecisionOracle, RoundedAnswers,
)
from .oracle.parallel import ParallelOracle
from .oracle.simulated import SimulatedOracle
from .models.rotary import RotaryAttention
from .oracle.transcript import TranscriptError
from .run.result import Extraction, load_model, save_extraction
from .lowprecision.learn import LowPrecisionExtraction
from .rotary.learn import RotaryExtraction
from .vector.learn import VectorExtraction
from .transformer.learn import TransformerExtraction, TransformerExtractionError, extract_transformer
from .models.transformer import Transformer1L, TransformerComparison, compare_transformers

__all__ = [
    "RotaryAttention",
    "AdditiveNoise", "BFloat16Oracle", "BudgetExceeded", "Check", "Comparison", "Extraction", "ExtractionError",
    "Float32Oracle", "GaussianNoise", "MixedPrecisionOracle", "MultiHeadAttention", "OracleError", "RoundedAnswers",
    "ParallelOracle", "SimulatedOracle", "TranscriptError",
    "Transformer1L", "TransformerComparison", "TransformerExtraction", "TransformerExtractionError",
    "UnreliableExtractionWarning", "Verification", "compare", "compare_transformers", "extract",
    "extract_transformer", "load_model", "save_extraction", "verify", "RotaryExtraction", "LowPrecisionExtraction", "VectorExtraction",
]
__version__ = "0.1.0"

#: Names that need the ``[torch]`` extra, imported on first use (``from mhaextract import TorchOracle``)
#: so that ``import mhaextract`` works without torch.
TORCH_NAMES = {name: "mhaextract.adapters.torch" for name in ("TorchOracle", "to_torch", "to_state_dict")}


def __getattr__(name):
    if name in TORCH_NAMES:
        import importlib

        try:
            module = importlib.import_module(TORCH_NAMES[name])
        except ImportError as error:
            raise ImportError(f"mhaextract.{name} needs torch: pip install 'mhaextract[torch]' ({error})") from error
        return getattr(module, name)
    raise AttributeError(f"module 'mhaextract' has no attribute {name!r}")
