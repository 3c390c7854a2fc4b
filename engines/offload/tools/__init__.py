"""Tools over a loaded engine: calibrate (cost-model inputs measured on this machine), selfcheck (exactness run)."""
