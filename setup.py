"""Package list for setuptools (everything else is in pyproject.toml).

The shipped cost models stay in the top-level ``models/`` folder of the source tree and travel in
the wheel as the package ``tunedb.models``; ``tunedb.costmodel.registry`` finds them through
``importlib.resources`` from an installed wheel and an editable checkout alike.
"""

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["tunedb", "tunedb.*", "collectors", "collectors.*"])
setup(packages=[*PACKAGES, "tunedb.models"], package_dir={"tunedb.models": "models"})
