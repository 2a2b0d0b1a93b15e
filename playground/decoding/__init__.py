"""Decoding algorithms, one file each, all on the `Decoder` interface of `base`."""

from .ar import AutoregressiveDecoder
from .base import DecodeOutput, Decoder, EngineClock, Stopper, encode_prompt, generate

ALGORITHMS: dict[str, type[Decoder]] = {AutoregressiveDecoder.algo: AutoregressiveDecoder}

__all__ = ["ALGORITHMS", "AutoregressiveDecoder", "DecodeOutput", "Decoder", "EngineClock", "Stopper",
           "encode_prompt", "generate"]
