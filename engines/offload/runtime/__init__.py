"""Runtime: the engine loop around one model.

    start(prompt) --> scheduler (admission, prefill chunks, preemption under the KV block budget)
      --> one forward per step: paged KV (kv.py), fused decode layers (fastpath.py) or the model's modules
      --> sampling per sequence (sampling.py) --> tokens, then stats (hits, bytes, ms/token)
"""
