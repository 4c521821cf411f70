"""The embedded vLLM-compatible simulator (`k3load sim`): a stand-in for rehearsal and tests, never
evidence for a production verdict."""
