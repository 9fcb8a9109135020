"""The workers: an engine in its role, driven on a loop thread, behind the async API the
router calls (in-process, or inside a Ray actor: ``pdserve/cluster/actors.py``).

``loop`` (``WorkerLoop``: what every role shares) and the three roles over it:
``prefill`` (``PrefillWorker``: the prefill role + KV sender), ``decode``
(``DecodeWorker``: reserves blocks, receives KV, decodes, streams tokens) and
``colocated`` (``ColocatedWorker``: both phases in one engine). Their parts:
``tensor_parallel`` (the TP leader: ``create_engine`` spawns the follower ranks),
``metrics_publisher``, ``core_share`` (cores lent between workers on one node) and
``step_fit`` (the worker's measured step times).

What the router shares with the workers stays at the top of the package:
``pdserve.messages``, ``pdserve.failures``, ``pdserve.output_stream`` (the token
stream's two ends), and ``pdserve.thread_loop`` (the KV channels' thread too).
"""
