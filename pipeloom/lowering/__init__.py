"""Lowering for the runtime (docs/design.md §2): ``lower(schedule)`` adds torch's send/receive actions
(``1SEND_F0``, ``2RECV_B3``, ...) to a compute-only schedule; the checks and the replay with which
the validator and the simulator treat a lowered schedule like any other.
"""

from pipeloom.lowering.add_comms import lower
from pipeloom.lowering.check import check_comms
from pipeloom.lowering.graph import CommGraph, Message
from pipeloom.lowering.replay import LoweredReplay, replay_lowered

__all__ = ["CommGraph", "LoweredReplay", "Message", "check_comms", "lower", "replay_lowered"]
