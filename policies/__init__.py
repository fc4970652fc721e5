"""The reference RLHFless policies and the baselines they are compared against, shipped as a plugin.

Each policy kind lives in its own module; ``plugin`` registers them all (entry point ``rlhfless-policies``).
"""
