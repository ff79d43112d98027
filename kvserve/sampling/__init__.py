"""Turning logits into tokens: penalties, temperature, top-k/p, min-p, seeds, logprobs."""
