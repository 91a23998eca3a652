"""What operators watch: ``server/status`` and ``server/history``, Prometheus metrics, the
``skyfed monitor`` terminal view and the ``skyfed dashboard`` page."""
