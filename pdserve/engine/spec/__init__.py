"""Speculative decoding: proposing draft tokens and verifying them in one target step.

``spec_decode`` (the draft-free proposers -- n-gram, suffix -- the rejection-sampling
verification and the acceptance statistics), ``draft_model`` (a small model with its own
KV cache that drafts tokens) and ``drafting`` (the engine's per-step drafting phase).
"""
