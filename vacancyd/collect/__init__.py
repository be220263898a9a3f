"""Collectors: loops that read the machine and write timestamped observations to shared state."""
