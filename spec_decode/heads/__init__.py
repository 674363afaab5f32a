"""Feature-level drafters' heads: small networks on the target's own decoder features."""
