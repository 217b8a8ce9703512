"""Per-step capture: one device buffer, one D2H copy into a host ring, per-sample assembly."""
