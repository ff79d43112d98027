"""Speculative decoding: proposers that draft tokens cheaply, the rule that verifies them
against the target model, and the policy that sizes (or switches off) drafting per step.

The policy is torch-free and runs inside the scheduler; proposers and verification run in
the torch runner, after the step's forward pass.
"""
