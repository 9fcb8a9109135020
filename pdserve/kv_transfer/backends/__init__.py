"""The KV transfer backends, one module per role (or one per backend), each over the
shared machinery one level up (``base``, ``sender_base``, ``receiver_base``, the
send/recv state, ``wire``, ``regions``, ``send_worker``):

* ``nixl``: ``nixl_send``, ``nixl_recv``, over ``nixl_agent`` (the agent and the
  notification format) and ``control_link`` (the TCP control connection and liveness);
* ``torch``: ``torch_send``, ``torch_recv``, over ``torch_group`` (the pair's groups);
* ``ray``: ``ray_conn``; ``local``: ``local_conn``.

Imported only by name, through ``kv_transfer.factory``, so a worker loads only its own.
"""
