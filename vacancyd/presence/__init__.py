"""Owner presence: who is at the machine, read by a platform backend and fed to the veto."""
