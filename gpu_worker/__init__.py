"""GPU workers: one process per device, running one batch at a time behind the Backend interface."""
