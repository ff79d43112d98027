"""The simulator and planner: the engine's own scheduler, KV manager and radix cache driven by a
runner that advances a virtual clock from a hardware cost model instead of running a model.

hardware.py (catalog), models.py (shapes, parameter counts), cost_model.py (roofline per step),
profiles.py (engine stacks as scheduler knobs), runner.py (SimRunner), simulate.py (the loop),
planner.py (the questions), calibrate.py (fit the CPU entry to measured steps), cli.py.
"""
