"""The engine: requests, the scheduler that batches them, and the loop that runs each step.

Nothing here imports torch; a runner (``kvserve.runner`` or ``kvserve.sim``) executes batches.
"""
