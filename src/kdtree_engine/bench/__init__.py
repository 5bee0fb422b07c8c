"""Benchmarks and plots."""
