"""Data planes: the engine contract (base), the mock engine, the offload executor, external engine processes."""
