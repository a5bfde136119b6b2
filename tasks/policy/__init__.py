"""Every decision of the system, as pure objects and functions: no Redis, kombu, Celery, SQL or Flask import.

Methods that depend on time take ``now``; the process shells (tasks.broker, webapp, gpu_worker) feed them and
act on their answers. tests/test_layers.py keeps it so.
"""
