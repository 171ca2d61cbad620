"""The server on rank 0: the Gradio UI, the OpenAI API, the job queue and store, logins, quotas, metrics,
webhooks."""
