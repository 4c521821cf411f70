"""The streaming client: one chat request -> one StreamResult with timings and reassembled output."""
