"""pdserve's benchmarks (``make bench``, ``make soak``): run from the repository root as
``python -m benchmarks.NAME``. Not part of the installed package: the wheel ships
``pdserve`` only. Each prints ratios against references measured in the same run and
names the CPU class it ran on."""
