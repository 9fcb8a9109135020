"""A deployment on Ray: the cluster config (``config``), the worker actors
(``actors``), bringing a cluster up and down (``cluster``), adding and removing workers
at runtime (``scaler``), the autoscale loop over the planner's policy (``autoscale``),
and the cluster-launcher / KubeRay recipes' checks (``recipes``)."""
