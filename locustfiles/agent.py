"""k3load's locustfile: agent scenarios replayed against a vLLM-compatible server, stage by stage.

    locust -f locustfiles/agent.py --headless --host http://127.0.0.1:8000 --k3-out runs/r1 --k3-plan smoke

Everything lives in the k3load package; this file only lets Locust find the user classes and the
shape, and registers the listeners.
"""

import locust  # noqa: F401  (first: gevent-patches sockets before anything else loads)
from locust import events

from k3load.loadgen import console
from k3load.loadgen.listeners import register
from k3load.loadgen.shape import PlanShape
from k3load.loadgen.users import AgentUser, ColdUser, LongInputUser, SharedPrefixUser

__all__ = ["AgentUser", "ColdUser", "LongInputUser", "PlanShape", "SharedPrefixUser"]

register(events)
console.register(events)  # library request logs off the console at the default level
