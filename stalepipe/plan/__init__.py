"""stalepipe.plan: filled by its own issue; empty for now."""
