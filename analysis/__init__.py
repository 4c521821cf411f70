"""k3load's judgment: joins the run directory's timelines into pillar verdicts, the 4-way verdict and
the reports. Installed as `k3load.analysis` (the folder is `analysis/` at the top of the repository;
the package name avoids the easily shadowed top-level name `analysis`)."""
