"""Unit tests: no server and no network; pure functions, local files, a CLI or a local tool (git, ssh-keygen) in a
subprocess at most. Seconds each."""
