"""Draft heads that read a frozen target's decoder states (no separate draft model)."""
