"""Triton (or CUDA) implementations, one file per op, named and shaped like its ref twin."""
