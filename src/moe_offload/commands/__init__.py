"""CLI command groups, one module per area; each defines `commands`, a list of click commands."""
