"""Serving decoders over HTTP with Ray Serve: `app` (building the application), `server` (the
`CompletionServer` deployment), `routes` and `streaming` (its ASGI side and server-sent events),
`protocol` and `schemas` (OpenAI's request/response bodies, `AppArgs`), `engine` and
`decode_process` (continuous batching, on a thread or in a child process), `guard` (the proxy's
body guard), `launch`, `running` and `cli` (`hlm serve`), and `vllm` (the same routes on vLLM
through Ray Serve LLM: `hlm serve --engine vllm`). Generation itself is `hlm_ray.generate`, which
needs no Ray.

    from hlm_ray.serve.app import build_app, make_app
    from hlm_ray.serve.schemas import AppArgs
    serve.run(make_app(AppArgs(model="runs/tiny-gen"), max_queued_requests=64))
"""
