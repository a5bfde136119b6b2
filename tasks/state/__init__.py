"""State held in Redis and shared by every process: fleet view, admission, claims, quarantine, results,
counters. Each kind is owned by one class with a ``from_settings`` constructor; key names are in keys.py."""
