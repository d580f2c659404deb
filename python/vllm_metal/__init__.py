"""vllm-metal: a vLLM hardware plugin for Apple Silicon.

Importing this package is cheap (vLLM imports plugins in every process); the
C++ core loads with ``vllm_metal.ops`` or ``vllm_metal._core``.
"""

__version__ = "0.1.0"
