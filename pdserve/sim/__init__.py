"""``pdserve simulate``: a deployment on a virtual clock (docs/planner.md).

pdserve's own code decides everything -- the router's admission order, routing
policies and disaggregation rule (``router/admission.py``, ``policies.py``,
``placing.py``), each engine's scheduler, block pool and prefix cache
(``engine/scheduler.py``, ``block_pool.py``) -- and only the model's forward pass and
the KV transfer are time models: step times from a measured profile or the analytic
GPU model (``planner/step_times.py``), transfer times from a link model (``link.py``).
"""
