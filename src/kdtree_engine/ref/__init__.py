"""The specification: plain numpy / torch on the CPU. Never imports triton."""
