"""Everything that speaks AMQP: the Celery app and its one task, request publishing, the batcher process's
consumer bootstep, recovery of lost workers' batches, and the batch jobs' feeder loop. The API side of the pipeline
(the gateway) is :mod:`tasks.gateway`, on top of this package."""
