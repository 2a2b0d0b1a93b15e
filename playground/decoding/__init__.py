"""Decoding algorithms, one file each, all on the `Decoder` interface of `base`."""

from .ar import AutoregressiveDecoder
from .base import DecodeOutput, Decoder, EngineClock, Stopper, encode_prompt, generate, stream_generate
from .lookahead import LookaheadDecoder
from .medusa import MedusaDecoder
from .prompt_lookup import PromptLookupDecoder
from .speculative import SpeculativeDecoder

ALGORITHMS: dict[str, type[Decoder]] = {
    cls.algo: cls for cls in (AutoregressiveDecoder, SpeculativeDecoder, PromptLookupDecoder, LookaheadDecoder,
                              MedusaDecoder)}

__all__ = ["ALGORITHMS", "AutoregressiveDecoder", "DecodeOutput", "Decoder", "EngineClock", "LookaheadDecoder",
           "MedusaDecoder", "PromptLookupDecoder", "SpeculativeDecoder", "Stopper", "encode_prompt", "generate",
           "stream_generate"]
