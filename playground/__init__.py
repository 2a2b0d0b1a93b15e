"""The decoding playground: an instrumented engine for plain and accelerated LLM decoding."""

__version__ = "0.1.0"
