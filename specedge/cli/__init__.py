"""Command-line entry points: `specedge <command>` and `export-models`."""
