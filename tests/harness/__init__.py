"""The test and benchmark harness: real processes and services started for one run, and the clients that load
them. ``tests/`` and ``bench/`` both import it (``from tests.harness.stack import Stack``); the repository root is
on ``sys.path`` for both (pytest's rootdir, ``python -m bench.X`` run from the root), so nothing edits the path.

- ``stack``: one system on the shared RabbitMQ, Redis and a ledger (gunicorn, batcher, workers) and its clean-up;
- ``services``: private RabbitMQ vhosts and nodes, a private Redis, and their pytest fixtures;
- ``loadgen``: the steady open-loop load (threads) and its report; ``pooled``: callers on one aiohttp pool;
- ``helpers``: small client helpers; ``models``: a tiny Llama built offline; ``admitting``: one call admitted
  through the round-trip admission API (production admits in rounds; unit tests mostly need one);
- ``netns``: the system as separate hosts in network namespaces, and cables pulled under load.
"""
