"""Native Llama-family transformer and the loader that resolves model specs to weights and tokenizers."""

from .loader import LoadedModel, ModelLoadError, load_model
from .transformer import SUPPORTED_ARCHITECTURES, Transformer, TransformerConfig, UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "ModelLoadError", "Transformer", "TransformerConfig",
           "UnsupportedModelError", "load_model"]
