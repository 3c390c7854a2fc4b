"""Control-plane tests (a package, so test module names cannot collide with other areas)."""
