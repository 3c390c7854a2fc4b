"""Experts: where each expert lives and where each routed (token, expert) pair is computed.

    [router: top_k_index, top_k_weights]  (transformers)
      -> split hits (slots: accelerator tier) | misses (store: host tier)
      -> misses by policy: compute on the host | fetch into a slot (LRU) | hybrid (cost model)
      -> combine in a fixed order (deterministic)             executor.py; counters in stats.py
"""
