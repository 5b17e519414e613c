"""Serving decoders on vLLM through Ray Serve LLM (`hlm serve --engine vllm`): `folder` (the
folder vLLM loads, with the readout folded into its logit layer), `app` (the OpenAI
application: Ray Serve LLM's ingress and server, the API key on every route), `server` (the
server that resolves its model on its own node). It imports `hlm_ray.serve`'s guard and
`hlm_ray.generate`'s model checks; nothing imports it but the serve command and the benchmark.
vLLM itself is an optional install (README, docs/serving.md).

    from hlm_ray.serve.vllm.app import VllmArgs, make_app
    serve.run(make_app(VllmArgs(model="runs/tiny-gen")), name="hlm", route_prefix="/")
"""
