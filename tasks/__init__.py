"""The core of the batching service: settings, message schema, flush policy, scheduler, batcher, result path.

``webapp`` and ``gpu_worker`` import from here and never from each other. Nothing here imports torch.
"""
