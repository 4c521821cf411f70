"""Integration tests against real servers on loopback: the embedded sim, whole Locust runs, Debian's nginx,
Prometheus and chromium. Seconds to minutes each; the `slow` marker names the whole-run suites."""
