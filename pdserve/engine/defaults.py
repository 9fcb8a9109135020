"""The engine's sizing defaults, in a module without torch: ``EngineConfig`` takes them
as its field defaults, and the planner (``planner/step_times.py``, which must not pull
torch into ``pdserve plan``) sizes pools with the very same numbers."""

BLOCK_SIZE = 16  # tokens per KV block
KV_CACHE_BYTES = 256 * 1024 * 1024  # a worker's KV cache when no block count is given
MAX_NUM_BATCHED_TOKENS = 2048  # tokens one step computes, over all sequences
MAX_NUM_SEQS = 64  # sequences one step runs
