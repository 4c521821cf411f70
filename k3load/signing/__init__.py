"""The signed record (issue 29): OpenSSH signatures over a run's manifest.sha256, made and checked."""
