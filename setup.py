"""Only the package layout lives here (the rest is in pyproject.toml): the top-level `analysis/` folder
is installed as `k3load.analysis`, so nothing ever imports a bare, easily shadowed `analysis`."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["k3load", "k3load.*"]), "k3load.analysis",
              *(f"k3load.analysis.{room}" for room in find_packages("analysis"))],
    package_dir={"k3load.analysis": "analysis"},
)
