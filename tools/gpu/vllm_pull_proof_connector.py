"""kvferry's connector, loadable on the vLLM the GPU test machine can install (0.25).

The H200 machine cannot install vLLM 0.32 (it pins a newer torch); 0.25 has the same NixlConnector
package (``kv_connector/v1/nixl/``) and every internal kvferry's connector checks at start
(``vllm_internals.check_vllm``). This module lowers the connector's version floor for that proof
run only, then exposes ``KvferryConnector`` unchanged: ``kv_connector_module_path`` =
``vllm_pull_proof_connector`` with ``tools/gpu`` on the engine's PYTHONPATH. On vLLM >= 0.32 it
changes nothing.
"""

from __future__ import annotations

import vllm
from kvferry.connector import vllm_internals

PROOF_MIN_VERSION = (0, 25)

if vllm_internals.parse_version(str(vllm.__version__)) < vllm_internals.SUPPORTED_MIN:
    vllm_internals.SUPPORTED_MIN = PROOF_MIN_VERSION

from kvferry.connector.connector import KvferryConnector  # noqa: E402 - after the floor is set

__all__ = ["KvferryConnector"]
