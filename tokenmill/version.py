"""tokenmill's version, in a leaf module: the engine reads it for info() without importing
the package's public names (tokenmill/__init__.py), which reach up to tokenmill.llm."""

__version__ = "0.1.0"  # also pyproject.toml's [project] version
