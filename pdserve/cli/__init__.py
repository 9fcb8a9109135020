"""The ``pdserve`` command line (``main``): ``serve`` (the service: ``serve``),
``generate``, ``bench``, ``top`` (``top``), ``plan``, ``scale`` / ``drain`` / ``down``
(``admin``), ``model``."""
