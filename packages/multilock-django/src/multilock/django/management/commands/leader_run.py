"""``manage.py leader_run``: see `multilock.django._leader_run` (Django finds commands here)."""

from multilock.django._leader_run import LeaderRunCommand as Command

__all__ = ["Command"]
