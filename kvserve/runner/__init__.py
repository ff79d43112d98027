"""Runners execute a scheduled batch. The torch runner runs the model on a paged KV cache;
the simulator's runner (``kvserve.sim``) advances a virtual clock instead."""
