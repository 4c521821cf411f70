"""Pillar 3, prefix caching: cold/warm pairs, metric deltas, reuse under load, replicas."""
