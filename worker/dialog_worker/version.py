"""The package's version (pyproject.toml's, which a test keeps equal): a module of its own so
that modules inside the package read it without importing the package's public names."""

__version__ = "0.1.0"
