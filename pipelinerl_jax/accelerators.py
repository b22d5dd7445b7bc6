"""The GPU cards the project measures on and plans for: their datasheet figures, and the memory a
process has on the ones it runs on. Imports nothing but the standard library.

A card is found from JAX's `device_kind` ('NVIDIA H100 80GB HBM3', 'NVIDIA H200', ...) by the
first `kind` in CARDS that the name contains: the PCIe and NVL parts and GH200 come before the
SXM parts whose names theirs contain. Peaks are dense (no sparsity) bf16 tensor-core rates;
memory and bandwidth are the datasheet's nominal figures, leads rather than ceilings (a kernel
is held against bandwidth measured on the card, as the GPU kit's env section measures it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Card:
  name: str                        # as `memory_plan --device` takes it
  kind: str                        # what JAX's device_kind contains
  bf16_tflops: float               # dense bf16 tensor-core peak, TFLOP/s
  source: str                      # where the figures come from
  memory_gb: float | None = None   # HBM, as the datasheet gives it
  bandwidth_tb_s: float | None = None  # HBM bandwidth, nominal
  # About what one process can allocate on the GPU machines the project runs on (nvidia-smi
  # shows 79.6 GiB on an H100 80GB and 140.4 on an H200; the driver and a CUDA context keep some).
  # None: not run on yet; give memory_plan --device_gib.
  usable_gib: float | None = None


CARDS = (
    Card('h100-pcie', 'H100 PCIe', 756.5, 'H100 PCIe datasheet', 80, 2.0),
    Card('h100-nvl', 'H100 NVL', 835.5, 'H100 NVL datasheet', 94, 3.9),
    Card('h200-nvl', 'H200 NVL', 835.5, 'H200 NVL datasheet', 141, 4.8),
    Card('gh200', 'GH200', 989.4, 'GH200 datasheet'),
    Card('h100', 'H100', 989.4, 'H100 SXM datasheet', 80, 3.35, usable_gib=78.0),
    Card('h200', 'H200', 989.4, 'H200 SXM datasheet', 141, 4.8, usable_gib=139.0),
    Card('a100', 'A100', 312.0, 'A100 datasheet'),
)
PLANNED = tuple(c.name for c in CARDS if c.usable_gib)  # the cards a plan can name


def card_of(device_kind: str) -> Card | None:
  """The card JAX's `device_kind` names, or None (a CPU, a card not listed)."""
  for card in CARDS:
    if card.kind.lower() in device_kind.lower():
      return card
  return None


def card_named(name: str) -> Card:
  """The card called `name` ('h100', 'h200', ...); ValueError naming the others if none is."""
  for card in CARDS:
    if card.name == name:
      return card
  raise ValueError(f'no card {name!r}: known cards are {", ".join(c.name for c in CARDS)}')


def describe(device_kind: str) -> dict:
  """The figures the GPU kit records beside every measurement: the device kind as JAX names it,
  the card it is, and that card's datasheet figures (None where the card is not listed)."""
  card = card_of(device_kind)
  if card is None:
    return dict(device_kind=device_kind, card=None, bf16_peak_tflops=None, memory_gb=None,
                bandwidth_tb_s=None, source=None)
  return dict(device_kind=device_kind, card=card.name, bf16_peak_tflops=card.bf16_tflops,
              memory_gb=card.memory_gb, bandwidth_tb_s=card.bandwidth_tb_s, source=card.source)
