"""Loading: a checkpoint as shipped -> a transformers model whose experts the offload executor serves.

    config.json --architecture--> which modules hold experts, their layout (fused, transposed, biases)
    safetensors --checkpoint--> expert tensors as stored (bf16 | FP8 blocks | MXFP4 blocks), or quantized at load (quant)
    loader.load_model --> model (dense weights on the accelerator) + host store + slot caches + Executor
"""
