"""Golden reference bundles: safetensors files of inputs and reference outputs, replayed by the tests."""

from kdtree_engine.golden.bundle import GENERATOR_VERSION, Bundle, read_bundle, write_bundle

__all__ = ["GENERATOR_VERSION", "Bundle", "read_bundle", "write_bundle"]
