"""The core of the batching service, by role (imports run one way, from the bottom up):

- config, schema, errors, logs: the vocabulary every layer uses;
- policy/: every decision, pure;
- state/ (Redis) and store/ (SQL): shared state, each kind owned by one class;
- broker/: Celery, kombu, the batcher process, the gateway the API calls;
- cli/: the admin CLI.

``webapp`` and ``gpu_worker`` import from here and never from each other. Nothing here imports torch.
"""
