"""`python -m tasks.cli`: the same as `llmb-admin`."""
from tasks.cli import main

main()
