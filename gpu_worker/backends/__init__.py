"""Model backends: :mod:`~gpu_worker.backends.interface` is what each one is to its worker (and all a backend
imports of this package's own); :mod:`~gpu_worker.backends.registry` builds one by name."""
