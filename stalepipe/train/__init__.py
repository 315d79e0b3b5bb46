"""Turning a config into a run."""
