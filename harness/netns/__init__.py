"""The system as separate hosts: one Linux network namespace per host, joined by a bridge, cables to pull.

    with Hosts(logs=Path("/tmp/run")) as h:     # namespaces, bridge, RabbitMQ + Redis, every process; serving
        load = h.load("api", 40)               # a SteadyLoad (harness/loadgen.py) sent from the client host
        h.cut("gpu1")                           # pull gpu1's cable: its packets are dropped silently, no RST
        h.restore("gpu1")
        report = load.stop()                    # leaving the block tears everything down, even on an error

- ``topology``: the namespaces, the bridge, the cables, threads that live on a host;
- ``servicehost``: the svc host's private RabbitMQ node and Redis, and what rabbitmqctl says of them;
- ``hosts``: :class:`~harness.netns.hosts.Hosts`, the harness (processes on their hosts, the client host,
  the system's state as it reads it, teardown), and whether this machine can run it (``unavailable``);
- ``sampler``: the batches outstanding on each worker, sampled under load;
- ``scenarios``: the cables pulled under load that tests/test_hosts.py asserts on and bench/hosts.py prints.
"""
