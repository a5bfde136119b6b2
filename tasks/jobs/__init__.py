"""The Batch API's job runner: the loop of ``llmb-jobs`` (:mod:`tasks.jobs.feeder`) and one job's run
(:mod:`tasks.jobs.job_run`). It knows nothing of HTTP or AMQP: what runs a line is given to it (:mod:`webapp.jobs`)."""
