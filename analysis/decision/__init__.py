"""The decision beside the verdict: the ramp's limits, the capacity figures and the sign-off checklist."""
