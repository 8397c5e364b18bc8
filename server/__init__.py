"""glimpse frontend: the CLI, the HTTP server (Starlette on uvicorn) and the process launcher."""
