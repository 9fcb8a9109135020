"""What operators watch, beside the router's own metrics (``router/metrics.py``,
``router/vllm_metrics.py``): each worker's ``/metrics`` (``worker_metrics``), device
peaks for MFU/MBU (``efficiency``), Prometheus HTTP/file service discovery
(``file_sd``), and a small OTLP receiver for the tracing tests and bench
(``otlp_sink``)."""
