"""The four pillars' judges and their shared result and rule types; one sub-package per pillar that needs more
than one module (agent API, prefix cache, headroom). Compatibility is judged by `k3load.precheck`."""
