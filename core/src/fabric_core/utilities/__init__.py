"""Small helpers shared by the facade and by plugins (no heavy imports here)."""
