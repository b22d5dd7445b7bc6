"""The host side of the JAX engine's paged KV cache: which pages are free and who holds them
(models/layers/paged_attention.py has the pool's device layout; slot_state.py the other kind of
storage a sequence holds, a hybrid's Gated DeltaNet state)."""

from __future__ import annotations


class PagePool:
  """The host's allocator of the pool's pages: ids 1..A-1 (0 is the trash page), each with a
  reference count (a prompt's pages are held by every sample that reads them)."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f'a KV pool needs at least 2 pages (one is the trash page), got '
                       f'{num_pages}')
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, 0, -1))  # popped from the end: lowest ids first
    self._refs = [0] * num_pages
    self.peak_in_use = 0

  @property
  def num_free(self) -> int:
    return len(self._free)

  def take(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(f'{n} pages asked, {len(self._free)} free')  # callers check first
    free, refs = self._free, self._refs
    pages = free[len(free) - n:]
    del free[len(free) - n:]
    pages.reverse()  # as popping one by one would give them
    for p in pages:
      refs[p] = 1
    in_use = self.num_pages - 1 - len(free)
    if in_use > self.peak_in_use:
      self.peak_in_use = in_use
    return pages

  def share(self, pages: list[int]) -> None:
    for p in pages:
      assert self._refs[p] > 0, f'page {p} is not in use'
      self._refs[p] += 1

  def release(self, pages: list[int]) -> None:
    for p in pages:
      self._refs[p] -= 1
      assert self._refs[p] >= 0, f'page {p} released twice'
      if self._refs[p] == 0:
        self._free.append(p)
