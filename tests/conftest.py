"""Test session setup: 8 simulated CPU devices, so sharded code runs as on a multi-GPU host.

XLA reads the flag once, when jax first initializes its backend, so it is set before any test
module imports jax. Single-device code simply runs on device 0.
"""
import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
