"""Pieces for running our tree path inside other serving engines (SGLang's DDTree port first)."""
