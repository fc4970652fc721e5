"""Shipped YAML presets (scheduler configs, hardware/model profiles); read with importlib.resources."""
