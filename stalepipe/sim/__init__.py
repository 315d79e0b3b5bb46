"""stalepipe.sim: filled by its own issue; empty for now."""
