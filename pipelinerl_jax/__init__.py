"""PipelineRL in JAX.

On import, before any module of the package can start a JAX backend: JAX would otherwise take
75% of every GPU it sees when its GPU backend starts, the GPUs the vLLM children use included
(vLLM then refuses to start, wanting 90% free), so preallocation is turned off. The backend
reads the variable when it starts (jaxlib's xla_client.generate_pjrt_gpu_plugin_options), and
spawned children inherit it. A user's own choice of any of these variables is left alone.
"""

import os as _os

JAX_GPU_MEMORY_VARS = ('XLA_PYTHON_CLIENT_PREALLOCATE', 'XLA_PYTHON_CLIENT_MEM_FRACTION',
                       'XLA_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_ALLOCATOR')
if not any(name in _os.environ for name in JAX_GPU_MEMORY_VARS):
  _os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
