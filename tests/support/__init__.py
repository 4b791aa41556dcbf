"""Helpers every test tier shares: polling for a condition, and a cluster of servers in this process.

- ``tests.support.waiting``: ``wait_until`` / ``wait_until_sync``, the one way a test waits.
- ``tests.support.cluster``: ``InProcessCluster`` and its ``ClusterOptions`` (the ``start_inprocess_cluster``
  fixture in ``tests/conftest.py`` starts one and stops it after the test).
"""
