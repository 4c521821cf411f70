"""The Locust side of k3load: options, the per-process session, user classes and the stage shape.

Locust events are the only seam: `register(environment.events)` attaches everything; the locustfile
only imports the user classes and the shape so that Locust finds them.
"""
