"""Sampling: what a request asks for and how its next token is picked.

``sampling_params`` (a request's parameters and their rules; no torch, the router
imports it), ``structured`` (structured-output constraints; no torch) and ``grammar``
(their token bitmasks), ``sampler`` (logits -> tokens, batched), ``logprobs``
(``TokenLogprob``), ``stop`` (stop tokens and strings).

It imports of the engine only ``kernels`` and ``tokenizer``: never the model,
speculation or the scheduling core (tests/test_layering.py).
"""
