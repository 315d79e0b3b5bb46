"""stalepipe.optim: filled by its own issue; empty for now."""
