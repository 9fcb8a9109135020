"""The model: what turns token ids and a KV cache into logits.

The Llama-family network (``model``) over its layers (``attention``: paged attention
and its backends; ``linear``: the projections and their kernel families; ``rope``),
the KV cache's element formats (``kv_cache``), and where the weights come from:
loading and sharding a checkpoint (``loader``, ``weights``), quantizing it at load
(``quant``, ``quant_load``), converting a GGUF file and caching the default model
(``gguf_convert``), and tiny random checkpoints for tests (``tiny``).

It imports of the engine only its leaves (``config``, ``defaults``, ``kernels``) and
``tp``: never sampling, speculation or the scheduling core (tests/test_layering.py).
"""
