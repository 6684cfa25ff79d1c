"""Client side: the Session and its rank pool (ipyparallel); never imports torch at module top."""
from .errors import RankError, RankTimeout, SessionError
from .session import Session

__all__ = ["Session", "RankError", "RankTimeout", "SessionError"]
