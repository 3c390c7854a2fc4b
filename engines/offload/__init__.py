"""The offload executor for transformers MoE models: expert store, slot caches, miss policies, route capture."""
