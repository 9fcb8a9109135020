"""Tensor parallelism inside one engine (this package: ``shard`` -- what a rank holds,
``collectives`` -- the ranks' group and its all-reduce, ``lockstep`` -- replaying the
leader's calls): N rank processes, each holding a shard of
every weight and of the KV heads, stepping in lockstep.

Sharding (Megatron style; ``Shard`` says what a rank holds, ``weights.shard_cut``
reads just that of the checkpoint): the fused QKV and gate/up projections
are column-parallel (each rank computes its heads / its slice of the MLP), the O and
down projections row-parallel (each rank's partial sums are all-reduced), the
embedding and the LM head vocab-parallel (an embedding lookup is masked to the rank's
rows then all-reduced; logits are gathered to rank 0). KV heads split across ranks,
or are replicated when there are fewer KV heads than ranks (each rank keeps the one
its query heads read). A rank's KV cache holds only its KV heads.

Lockstep (``LLMEngine`` with a ``TPGroup``): rank 0 is the leader -- the worker
calls it like any engine; each call that changes engine state (``add_request``,
``step``, ``abort``, ...) is first broadcast to the followers, which replay it on
their own engine (``lockstep.follow``). Every rank therefore schedules the same batch and
allocates the same block ids; only rank 0 samples, and it broadcasts the sampled
token ids so every rank appends the same tokens.

Process model (``pdserve/worker/tensor_parallel.py``, a layer over the engine and the KV
channels): the followers are processes the leader spawns on the same node -- one per
rank, each with its own CPU threads or GPU, and each with its own KV transfer channel
over its KV heads, driven by the leader through a pipe (``kv_transfer.sharded``). A
follower that dies breaks the leader's next collective (an error, or the group's
timeout), so the worker fails as a whole and is restarted as a whole.

Collectives run on a c10d group of their own (gloo on CPU, NCCL on CUDA) over a
TCPStore the leader hosts, never the global default group.
"""
