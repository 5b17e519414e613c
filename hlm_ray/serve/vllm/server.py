"""`HLMLLMServer`: Ray Serve LLM's `LLMServer` that finds its model on its own node.

`build_app` resolves the model (a registry URI is downloaded, a readout folded in:
`hlm_ray.serve.vllm.folder`) where the application is built: the driver, or the Serve
controller on a cluster's head node. A replica placed on another node would not find that
folder; this server resolves the same model again where it runs (`local_source`), from the
reference and readout the application put in its environment, before vLLM starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from ray.serve.llm.deployment import LLMServer

from hlm_ray.serve.vllm.app import MODEL_ENV, READOUT_ENV


def local_source(source: str, env: dict[str, str] | None = None) -> str:
    """The folder vLLM loads on this node: `source` when it is here, else the model the
    environment names, resolved and served here (the same files, the same readout)."""
    if Path(source).is_dir():
        return source
    env = os.environ if env is None else env
    from hlm_ray.pretrained import resolve_model_dir
    from hlm_ray.serve.vllm.folder import served_folder

    folder = resolve_model_dir(env[MODEL_ENV])
    return str(served_folder(folder, env.get(READOUT_ENV) or None)[0])


class HLMLLMServer(LLMServer):
    async def start(self):
        loading = self._llm_config.model_loading_config
        loading.model_source = local_source(str(loading.model_source))
        await super().start()
