"""k3load: judge whether a Kimi K3 deployment on vLLM may go to production."""

__version__ = "0.1.0"
