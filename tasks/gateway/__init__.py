"""The API side of the pipeline, free of HTTP and of AMQP's own machinery: a call admitted (in rounds, past the
turnstile), published through :mod:`tasks.broker.queues`, and waited for; calls looked up by id and followed by
Idempotency-Key; the admission lease; readiness. The web app, the admin CLI and the Batch API's runner submit
through :class:`tasks.gateway.gateway.Gateway`."""
