"""Training of the shipped kimi-nano target and its DFlash drafter."""
