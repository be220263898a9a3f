"""vacancyd: lend an idle workstation GPU without taking the machine from its owner."""

__version__ = "0.1.0"
