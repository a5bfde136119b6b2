"""The test and benchmark harness: real processes and services started for one run, and the clients that load
them. ``tests/`` and ``bench/`` both import it (``from harness.stack import Stack``) and it imports neither, so
neither imports the other. The repository root is on ``sys.path`` for both (pytest's ``pythonpath``, ``python -m
bench.X`` run from the root), so nothing edits the path. Not shipped: the wheel holds tasks, webapp and gpu_worker.

- ``stack``: one system on the shared RabbitMQ, Redis and a ledger (gunicorn, batcher, workers) and its clean-up;
- ``services``: private RabbitMQ vhosts and nodes, a private Redis, and their pytest fixtures;
- ``loadgen``: the steady open-loop load (threads) and its report; ``pooled``: callers on one aiohttp pool;
- ``helpers``: small client helpers; ``models``: a tiny Llama built offline; ``admitting``: one call admitted
  through the round-trip admission API (production admits in rounds; unit tests mostly need one);
- ``hostile``: hostile callers (made-up models, random keys, hostile numbers, raw pipelined and slow connections,
  batch jobs) and the steady caller beside them, for tests/test_hostile_*.py and ``python -m bench.hostile``;
- ``stats``: the one percentile of every report and test;
- ``netns``: the system as separate hosts in network namespaces, and cables pulled under load.
"""
