"""Decoding algorithms as proposers for the one engine, one file each; `registry` names them."""

from .base import DecodeOutput, Stopper, encode_prompt

__all__ = ["DecodeOutput", "Stopper", "encode_prompt"]
