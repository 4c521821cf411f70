"""Comparison with another run: agreement with a reference run's tool-call behaviour and its report section."""
