"""Reproducible training of the small models the accelerated decoders need (`python -m playground.train`)."""
