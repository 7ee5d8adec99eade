"""Drafters: propose the next k tokens (and, for sampling, their probabilities) for the target to verify."""
