"""`kvsched http`: an OpenAI-compatible HTTP front end (FastAPI + uvicorn) that speaks to kvsched
only through the public gRPC client (kvsched.client), so any number of replicas can serve one
daemon or a cluster. Needs the `http` extra: `pip install 'kvsched[http]'`. Guide: docs/HTTP.md.

Modules: args (the CLI), errors (OpenAI's error shape; kvsched's gRPC statuses mapped to HTTP
in one place), schemas (request validation), text (tokenizer, chat template, incremental
detokenization, stop strings), backend (the daemons: failover, resume, abort), generation (one
request's tokens into text events), routes (the FastAPI app), metrics (Prometheus).
"""
