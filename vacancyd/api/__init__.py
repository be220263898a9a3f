"""The operator's API: health, readiness, status, metrics, admin switches, owner console."""
