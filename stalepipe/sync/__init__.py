"""stalepipe.sync: filled by its own issue; empty for now."""
