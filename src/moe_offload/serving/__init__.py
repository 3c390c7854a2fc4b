"""Serving: the OpenAI-compatible worker and the expert-affinity gateway.

    clients --> gateway (classify, affinity - lambda x load, proxy) --> worker (OpenAI API, /metrics) --> Engine

    worker.py (routes: create_app) --protocol.py validate--> requests.py (GenRequest)
        --> completions.Worker --queue.EngineRunner (engine thread)--> events.py (TokenEvent ... DoneEvent)
        --detok.TextStream, chat_output (reasoning.py, tools.py), logprobs.py-->
        JSON (completions.py, responses.py models) | SSE (streaming.py);  metrics.py: /metrics
    gateway.py --classify.py, pool.py (WorkerPool)--> proxy to a worker; reads back http.py's headers
    shared: http.py (body limit, API key, header names), errors.py (OpenAI error objects),
            server.py (uvicorn on a bound socket), openapi.py (/openapi.json), defaults.py (generation_config)

Nothing here imports torch: the worker reaches torch only through the engine a
backend builds, and the gateway runs without it.
"""
