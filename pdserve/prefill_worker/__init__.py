"""A prefill pool member: engine in the prefill role + KV sender."""
