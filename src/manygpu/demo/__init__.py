"""The main job: real training of a small CNN on every local device."""
