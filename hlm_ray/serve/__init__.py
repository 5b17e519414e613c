"""Serving decoders over HTTP with Ray Serve: `app` (the deployment and its builders), `schemas`
(request/response bodies, `AppArgs`), `cli` (`hlm serve`). Generation itself is
`hlm_ray.generate`, which needs no Ray.

    from hlm_ray.serve.app import build_app, make_app
    from hlm_ray.serve.schemas import AppArgs
    serve.run(make_app(AppArgs(model="runs/tiny-gen"), max_queued_requests=64))
"""
