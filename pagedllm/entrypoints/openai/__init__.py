"""OpenAI-compatible HTTP server: `pagedllm serve`, then any OpenAI client.

protocol.py holds the request/response bodies, server.py the FastAPI app, serving_*.py the
endpoint logic, metrics.py the Prometheus collectors and serve_cmd.py the command line.
"""
