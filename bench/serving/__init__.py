"""The parts of the LLM serving benchmark (``python -m bench.llm``, whose module docstring says what it measures):

- ``sse``: the client of one streamed ``/v1/completions`` call (server-sent events), timed;
- ``arrivals``: the open-loop Poisson sequence of calls and its driver;
- ``workers``: the system under test and its workers' lifecycle (start, ready, idle, graceful stop), their counters;
- ``ledger``: what the outcome ledger says of the batches a worker ran;
- ``generation``: one generation run (sim-lm continuous or static) and its figures, rescaled to the modelled device;
- ``embeddings``: the hf-embed throughput, in process and through the pipeline;
- ``markdown``: the report's tables.
"""
