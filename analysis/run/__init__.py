"""Run data: what a run directory holds, read into the frames, indexes and intervals every judge uses (records,
metrics, GPU rows, events, down spells). Nothing here judges."""
