"""Weights from the trainer to generators: HF-named tensor views and bucketed collectives (the
object-store path is Ray's, see generation/actors/updates.py)."""
