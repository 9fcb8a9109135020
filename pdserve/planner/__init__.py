"""Sizing prefill and decode pools for SLOs: step-time models (measured profiles or
the analytic GPU model: ``step_times``, ``profile``), the queueing model that turns
them into TTFT/TPOT predictions and pool sizes (``sizing``), ``pdserve plan``
(``cli``), and the autoscaler's policy over load snapshots (``autoscaler``; the
runtime loop that applies it is ``pdserve/cluster/autoscale.py``). No Ray here."""
