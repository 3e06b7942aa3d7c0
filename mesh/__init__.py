"""trio-mesh: a peer-supervised distributed worker mesh on Redis, for trio.

Every worker is a peer: it holds a lease in Redis, serves queues, and
recycles the processes of peers whose lease ran out. There is no server of
our own. See ``docs/`` for concepts and guarantees, ``protocol/`` for the
Redis protocol.

The public API is what this module exports; everything in ``mesh._*`` is
private.
"""

from ._browse import Job as Job
from ._browse import JobPage as JobPage
from ._browse import MinuteCounts as MinuteCounts
from ._client import Client as Client
from ._client import open_client as open_client
from ._errors import ClosedError as ClosedError
from ._errors import CommandError as CommandError
from ._errors import ConfigError as ConfigError
from ._errors import ConflictError as ConflictError
from ._errors import DeadLetterError as DeadLetterError
from ._errors import FencedError as FencedError
from ._errors import MeshConnectionError as MeshConnectionError
from ._errors import MeshError as MeshError
from ._errors import OutOfMemoryError as OutOfMemoryError
from ._errors import ProtocolError as ProtocolError
from ._fleet import Fleet as Fleet
from ._fleet import open_fleet as open_fleet
from ._group_reads import GroupInfo as GroupInfo
from ._group_reads import GroupSettings as GroupSettings
from ._group_reads import GroupsLook as GroupsLook
from ._keys import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._lease import LeaseTiming as LeaseTiming
from ._loop import cancel_reason as cancel_reason
from ._policy import QueuePolicy as QueuePolicy
from ._reads import QueueInfo as QueueInfo
from ._runner import MOVED as MOVED
from ._runner import Batched as Batched
from ._runner import BatchHandler as BatchHandler
from ._runner import Handler as Handler
from ._schedule import Schedule as Schedule
from ._topology import namespace_slot as namespace_slot
from ._types import DeadLetter as DeadLetter
from ._types import DelayedTask as DelayedTask
from ._types import Process as Process
from ._types import QueueShare as QueueShare
from ._types import ReconcileResult as ReconcileResult
from ._types import WorkerInfo as WorkerInfo
from ._url import RedisConfig as RedisConfig
from ._url import parse_url as parse_url
from ._worker import Worker as Worker
from ._worker import WorkerStatistics as WorkerStatistics
from ._worker import open_worker as open_worker

__version__ = "0.1.0"
