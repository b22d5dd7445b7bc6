"""How the kit shares its time budget: each part (a section, or a part of one) gets its
weight's share of what is left when it starts, so time a part leaves unused passes on to those
after it; a part's process is killed a short grace after its share ends."""

from __future__ import annotations

MIN_SECTION_S = 3.0          # a share shorter than this is not started
KILL_GRACE_S = 10.0          # past its share a section is killed after at most this


def share_of_budget(remaining_s: float, weights_left: list[float]) -> float:
  """Seconds for the first of the parts left, whose weights are `weights_left`: its weight's
  share of what remains."""
  return max(0.0, remaining_s) * weights_left[0] / sum(weights_left)


def kill_after(share_s: float) -> float:
  """When a section's process is killed: its share, then a grace of a quarter of it (a second
  at least, KILL_GRACE_S at most) to finish the item under way."""
  return share_s + min(KILL_GRACE_S, 1.0 + 0.25 * share_s)
