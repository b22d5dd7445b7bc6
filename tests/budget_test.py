"""A generator's memory rule (generation/budget.py) and what the vLLM engine passes vLLM on each
device (engine.device_kwargs, checked for CUDA with a given (free, total), without a GPU)."""

import pytest

from pipelinerl_jax.generation import budget

GIB = budget.GIB


def test_vllm_gets_the_share_minus_what_the_device_holds_and_what_is_reserved():
  total = 80 * GIB
  # An empty GPU but for this process's CUDA context and a 14 GiB staging buffer.
  used = 14 * GIB + GIB // 2
  fraction = budget.vllm_memory_fraction(0.9, total - used, total, reserve_bytes=0)
  assert fraction * total == pytest.approx(0.9 * total - used, abs=1)
  # Once vLLM has taken its fraction, the device holds the share (vLLM's startup check, free
  # >= fraction x total, holds by construction).
  assert used + fraction * total == pytest.approx(0.9 * total, abs=1)
  assert total - used >= fraction * total
  # What this process allocates later comes out of vLLM's part.
  later = budget.vllm_memory_fraction(0.9, total - used, total, reserve_bytes=2 * GIB)
  assert (fraction - later) * total == pytest.approx(2 * GIB, abs=1)


def test_a_share_the_device_cannot_give_is_refused_in_one_line():
  with pytest.raises(ValueError) as e:
    budget.vllm_memory_fraction(0.5, 40 * GIB, 80 * GIB)  # another process holds half already
  message = str(e.value)
  assert message.startswith('generation.vllm.gpu_memory_utilization=0.5 of 80.0 GiB leaves vLLM '
                            '0.00 GiB: 40.00 GiB are in use') and '\n' not in message
  with pytest.raises(ValueError, match=r'must be in \(0, 1\]'):
    budget.vllm_memory_fraction(0.0, 80 * GIB, 80 * GIB)


def test_updates_travel_in_vllms_serving_dtype_over_nccl_only():
  assert budget.wire_dtype('nccl', 'vllm', 'bfloat16', 'float32') == 'bfloat16'
  assert budget.wire_dtype('nccl', 'vllm', 'float32', 'float32') == 'float32'
  assert budget.wire_dtype('nccl', 'vllm', None, 'float32') == 'float32'  # dtype unknown
  assert budget.wire_dtype('gloo', 'vllm', 'bfloat16', 'float32') == 'float32'  # CPU fp32 head
  assert budget.wire_dtype('nccl', 'jax', 'bfloat16', 'float32') == 'float32'  # JAX engine
  assert budget.serving_dtype({'torch_dtype': 'bfloat16'}) == 'bfloat16'
  assert budget.serving_dtype({'dtype': 'float16', 'torch_dtype': 'bfloat16'}) == 'float16'
  assert budget.serving_dtype({}) is None


def test_staged_bytes_align_every_tensor():
  assert budget.staged_bytes([(3,), (2, 2)], 'bfloat16') == 2 * budget.ALIGN
  assert budget.staged_bytes([(128,), (64, 2)], 'float32') == 2 * 512
  assert budget.largest_tensor_bytes([(3,), (10, 10)], 'float32') == 400


def test_engine_device_kwargs_per_platform():
  from pipelinerl_jax.generation.vllm import engine  # torch only: vLLM is imported later
  config = engine.VllmEngineConfig(kv_cache_bytes=64 << 20, gpu_memory_utilization=0.9,
                                   reserve_bytes=GIB)
  # CPU: the explicit KV size, eager (whatever the GPU settings say).
  assert engine.device_kwargs(config, on_cuda=False) == dict(
      kv_cache_memory_bytes=64 << 20, enforce_eager=True)
  # CUDA: a fraction from the share and the free memory, CUDA graphs on.
  got = engine.device_kwargs(config, on_cuda=True, mem_info=(78 * GIB, 80 * GIB))
  assert set(got) == {'gpu_memory_utilization', 'enforce_eager'} and not got['enforce_eager']
  assert got['gpu_memory_utilization'] == budget.vllm_memory_fraction(0.9, 78 * GIB, 80 * GIB,
                                                                      GIB)
  eager = engine.VllmEngineConfig(gpu_memory_utilization=0.9, cuda_graphs=False)
  assert engine.device_kwargs(eager, on_cuda=True, mem_info=(80 * GIB, 80 * GIB))[
      'enforce_eager']
  # A share of 0: the explicit size on CUDA too.
  fixed = engine.VllmEngineConfig(kv_cache_bytes=1 << 30, gpu_memory_utilization=0.0)
  assert engine.device_kwargs(fixed, on_cuda=True, mem_info=(80 * GIB, 80 * GIB)) == dict(
      kv_cache_memory_bytes=1 << 30, enforce_eager=False)
