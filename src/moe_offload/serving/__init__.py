"""Serving: the OpenAI-compatible worker and the expert-affinity gateway.

    clients --> gateway (classify, affinity - lambda x load, proxy) --> worker (OpenAI API, /metrics) --> Engine

Nothing here imports torch: the worker reaches torch only through the engine a
backend builds, and the gateway runs without it.
"""
