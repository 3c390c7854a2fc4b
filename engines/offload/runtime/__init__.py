"""Runtime: the engine loop around one model, in rooms as nano-vllm's engine/.

    build.py        checkpoint + options --control.resolve (placement) + loader--> OffloadEngine
    engine.py       OffloadEngine: start(prompt) -> step() loop -> Generation; close, stats
      scheduler.py    waiting / running sequences --schedule()--> SchedulerOutput (admission, prefill chunks,
                      decode tokens first, preemption under the KV block budget)
      model_runner.py SchedulerOutput --input layout (ids, positions, slot mapping, key layout)--> one forward:
                      paged KV (kv.py), fused decode layers (model/fastpath.py), or per sequence --> logits
      output.py       logits --sampling per sequence (sampling.py), stop / length checks--> tokens; finish
      speculative.py  drafts (prompt lookup, a draft model) carried into a step and verified by it
      accounting.py   executor counters per forward --> each request's stats (hits, bytes, ms) --> engine totals
    kv_budget.py    KVCacheConfig, bytes per token (probe), the pool's bytes --> KVPool (kv.py) + max_model_len
      kv_quant.py     --kv-cache-dtype int8 | fp8: rows as codes with a scale per (row, head), and back
    prefix_cache.py full KV blocks by a hash chain, shared by reference, evicted LRU; KV events

What a layer computes lives in model/, the --tensor-parallel ranks in ranks/.
"""
