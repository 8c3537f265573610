"""The KDA gate (standard and bounded)."""

from .naive import naive_kda_gate as kda_gate

__all__ = ["kda_gate"]
