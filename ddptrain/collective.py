"""``barrier`` and ``broadcast_from_rank_zero`` across workers, through the driver.

They work with any backend, before or without a torch process group. Each call is a
round gathered by the driver, which names late ranks in a warning after a few seconds.
"""

from __future__ import annotations

import pickle
from typing import TypeVar

import cloudpickle

from ddptrain.context import _get_session
from ddptrain.wire import protocol

__all__ = ["barrier", "broadcast_from_rank_zero"]

T = TypeVar("T")


def broadcast_from_rank_zero(data: T) -> T:
    """Return rank 0's ``data`` on every rank. Every rank must call it.

    Args:
        data: Any picklable object (only rank 0's is used).

    Example:
        >>> run_tag = broadcast_from_rank_zero(make_tag() if rank == 0 else None)
    """
    session = _get_session("collective.broadcast_from_rank_zero")
    if session.channel is None:
        return data
    session.collective_index += 1
    rank = session.context.get_world_rank()
    payload = cloudpickle.dumps(data) if rank == 0 else None
    reply = session.call_driver(protocol.Collective(rank, session.collective_index, payload))
    assert isinstance(reply, protocol.CollectiveResult), reply
    result: T = pickle.loads(reply.data)  # type: ignore[arg-type]
    return result


def barrier() -> None:
    """Wait until every rank has called ``barrier()``."""
    _get_session("collective.barrier")
    broadcast_from_rank_zero(None)
