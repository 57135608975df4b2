"""longattn's command-line tools (console scripts declared in pyproject.toml)."""
