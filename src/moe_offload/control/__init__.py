"""The control plane: what is resident where, and what it will cost. Pure Python; never imports torch or engines.

    config.json --spec.ModelSpec--> layers, experts, top-k, bytes per expert (as stored)
    backend tiers + spec --budget.plan_budget(accelerators, context, reserve)--> expert slots per tier and layer
    engine route capture --profile.Profile--> counts[layer][expert] (per request class)
    Profile + slots --placement.plan(policy)--> rm_core.Placement (+ predicted hit rates)
    Placement + calibration | hardware profile --costmodel.predict--> predicted ms/token (`auto` = argmin)

Shared words (formats, block sizes, miss policies) live in vocab.py; units.py parses sizes.
"""
