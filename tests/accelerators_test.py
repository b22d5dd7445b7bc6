"""accelerators.py: the cards found from the device kinds JAX reports, their figures, and the
cards a memory plan can name."""

import pytest

from pipelinerl_jax import accelerators


@pytest.mark.parametrize('device_kind, name', [
    ('NVIDIA H100 80GB HBM3', 'h100'),      # seen on the H100 machines (SXM)
    ('NVIDIA H200', 'h200'),                # seen on the H200 machines (SXM)
    ('NVIDIA H100 PCIe', 'h100-pcie'),
    ('NVIDIA H100 NVL', 'h100-nvl'),
    ('NVIDIA H200 NVL', 'h200-nvl'),
    ('NVIDIA GH200 480GB', 'gh200'),        # not the H200 its name contains
    ('NVIDIA A100-SXM4-80GB', 'a100'),
])
def test_cards_from_device_kinds(device_kind, name):
  assert accelerators.card_of(device_kind).name == name
  assert accelerators.describe(device_kind)['card'] == name


def test_the_h200_is_the_h100s_compute_with_more_and_faster_memory():
  h100, h200 = accelerators.card_named('h100'), accelerators.card_named('h200')
  assert h100.bf16_tflops == h200.bf16_tflops == 989.4
  assert (h100.memory_gb, h200.memory_gb) == (80, 141)
  assert (h100.bandwidth_tb_s, h200.bandwidth_tb_s) == (3.35, 4.8)
  assert h100.usable_gib < h100.memory_gb and h200.usable_gib < h200.memory_gb
  assert accelerators.PLANNED == ('h100', 'h200')


def test_an_unknown_card_or_a_cpu():
  assert accelerators.card_of('cpu') is None
  facts = accelerators.describe('cpu')
  assert facts['device_kind'] == 'cpu' and facts['card'] is None
  assert facts['bf16_peak_tflops'] is None
  with pytest.raises(ValueError, match='no card .h300.: known cards are h100-pcie, '):
    accelerators.card_named('h300')
