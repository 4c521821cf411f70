"""What a judgment writes: the Markdown and HTML reports, plots, alerts, the dashboard and the manifest; one module
per output."""
